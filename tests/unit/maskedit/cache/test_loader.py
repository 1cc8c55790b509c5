"""The row loader: a step's rows reach the device in block order, verified, from verify threads or the loader's own."""

import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from maskedit.cache import entry_file
from maskedit.cache.integrity import CorruptEntry
from maskedit.cache import loader as loader_mod
from maskedit.cache.loader import Y_ROWS, RowLoader, default_verify_threads
from maskedit.cache.store import ActivationStore
from maskedit_lab.harness.baselines import PreloadedRowLoader

STEPS, BLOCKS, N, D = 2, 6, 64, 32


@pytest.fixture
def entry(tmp_path, monkeypatch):
    monkeypatch.setattr(entry_file, "SMALL_BYTES", 4096)  # the rows are verified when read, not at open
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    y = np.random.default_rng(0).standard_normal((STEPS, BLOCKS, N, D), dtype=np.float32)
    path = store.put("k", {"y": y}, {"y_blocks": list(range(BLOCKS)), "kv_blocks": []})
    e = store.open("k")
    e.path_, e.expected = path, y
    return e


def corrupt(e, step, i):
    """Overwrite bytes of one chunk in the file behind the mapping (as silent memory or disk corruption would)."""
    st = e.path_.stat()
    with open(e.path_, "r+b") as f:
        f.seek(int(e.arrays["y"][step, i].ctypes.data - e.mapping.ctypes.data) + 8)
        f.write(os.urandom(32))
    os.utime(e.path_, ns=(st.st_atime_ns, st.st_mtime_ns))


def job(entry):
    return SimpleNamespace(entry=entry, modes=["y"] * BLOCKS, futures={}, load_s=0.0, text_len=0)


def step_rows(loader, jc, step, report=True):
    """Run one step's blocks in order, as a model does: report each block, take its rows (or the error)."""
    reached = loader.start_step([(jc, step)], lambda jc, b: [Y_ROWS])
    get, out = loader.rows(jc, step), []
    for b in range(BLOCKS):
        if report and reached is not None:
            reached(b)
        try:
            out.append(get(b, Y_ROWS).clone())
        except CorruptEntry as e:
            out.append(e)
    return out


@pytest.mark.parametrize("threads", [1, 3])
def test_every_block_gets_its_own_rows_and_only_a_corrupt_chunk_fails(entry, threads):
    loader = RowLoader("cpu", heads=2, head_dim=16, verify_threads=threads)
    try:
        jc = SimpleNamespace(entry=entry, modes=["y"] * BLOCKS, futures={}, load_s=0.0, text_len=0)
        for b, got in enumerate(step_rows(loader, jc, 1)):
            torch.testing.assert_close(got, torch.from_numpy(entry.expected[1, b]), rtol=0, atol=0)
        corrupt(entry, 0, 4)
        got = step_rows(loader, jc, 0)
        assert isinstance(got[4], CorruptEntry) and "checksum mismatch in y chunk 4" in str(got[4])
        assert all(isinstance(g, torch.Tensor) for i, g in enumerate(got) if i != 4)
    finally:
        loader.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_the_loader_waits_for_reported_blocks_and_gives_up_on_silent_ones(entry, threads, monkeypatch):
    """One block ahead at most: a step whose blocks report never stalls; one whose blocks stay silent still gets every
    row, each load after the window's patience (a stall), rather than waiting for good."""

    class QuickWindow(loader_mod._Window):
        def __init__(self, ahead):
            super().__init__(ahead, patience=0.05)

    loader = RowLoader("cpu", heads=2, head_dim=16, ahead_blocks=1, verify_threads=threads)
    try:
        assert all(isinstance(g, torch.Tensor) for g in step_rows(loader, job(entry), 0))  # a second's patience
        assert loader.stalls == 0
        monkeypatch.setattr(loader_mod, "_Window", QuickWindow)
        assert all(isinstance(g, torch.Tensor) for g in step_rows(loader, job(entry), 1, report=False))
        assert loader.stalls >= 1
    finally:
        loader.close()


def test_verification_runs_on_several_threads_ahead_of_the_copies(entry, monkeypatch):
    """With verify threads, the chunks of later blocks are hashed while the loader copies earlier ones: no chunk is
    copied before its own check, and the checks ran on more than one thread."""
    seen, order, mu = set(), [], threading.Lock()
    verify = entry.verify
    together = threading.Barrier(2, timeout=10)  # the first two checks must be in flight at once (else it breaks)

    def spy(name, *index):
        with mu:
            seen.add(threading.current_thread().name)
        if index[1] < 2:  # blocks 0 and 1: hashed by two threads at once, or the barrier breaks the check
            together.wait()
        verify(name, *index)
        with mu:
            order.append(("verified", index))

    monkeypatch.setattr(entry, "verify", spy)
    loader = RowLoader("cpu", heads=2, head_dim=16, verify_threads=3)
    real_load = loader.load

    def load(jc, step, b, kind, verified=False):
        assert verified
        with mu:
            assert ("verified", (step, b)) in order, "copied before its check"
            order.append(("copied", (step, b)))
        return real_load(jc, step, b, kind, verified)

    monkeypatch.setattr(loader, "load", load)
    try:
        jc = SimpleNamespace(entry=entry, modes=["y"] * BLOCKS, futures={}, load_s=0.0, text_len=0)
        assert all(isinstance(g, torch.Tensor) for g in step_rows(loader, jc, 0))
        assert len(seen) > 1 and all(n.startswith("cache-verify") for n in seen)
        assert [i for k, i in order if k == "copied"] == [(0, b) for b in range(BLOCKS)]
    finally:
        loader.close()


@pytest.mark.parametrize("cores, gpu_threads", [(1, 1), (2, 1), (4, 2), (16, 8), (64, 8)])
def test_verify_threads_half_the_usable_cores_up_to_8_and_only_on_a_gpu(monkeypatch, cores, gpu_threads):
    monkeypatch.setattr(loader_mod, "usable_cores", lambda: cores)
    assert default_verify_threads(False) == 1
    assert default_verify_threads(True) == gpu_threads


def _cgroup(tmp_path, membership: str, files: dict) -> tuple:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    return tmp_path, tmp_path / "self-cgroup"


def test_a_cgroup_cpu_quota_bounds_the_usable_cores(tmp_path, monkeypatch):
    """A Kubernetes CPU limit is a cgroup quota, not a CPU set: a pod limited to 2.5 CPUs on a 64-core node gets 3
    cores' worth of verify threads' budget, not 64. The tightest quota along the cgroup's path counts (v2 and v1)."""
    v2 = _cgroup(tmp_path / "v2", "0::/kubepods/pod1/ctr\n", {
        "kubepods/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "250000 100000\n",
        "kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert loader_mod.cgroup_cpu_quota(*v2) == 2.5
    v1 = _cgroup(tmp_path / "v1", "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n"})
    assert loader_mod.cgroup_cpu_quota(*v1) == 1.5
    none = _cgroup(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert loader_mod.cgroup_cpu_quota(*none) is None
    assert loader_mod.cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent" / "cgroup") is None

    monkeypatch.setattr(loader_mod.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(loader_mod, "cgroup_cpu_quota", lambda: 2.5)
    assert loader_mod.usable_cores() == 3 and default_verify_threads(True) == 1
    monkeypatch.setattr(loader_mod, "cgroup_cpu_quota", lambda: 0.2)
    assert loader_mod.usable_cores() == 1
    monkeypatch.setattr(loader_mod, "cgroup_cpu_quota", lambda: None)
    assert loader_mod.usable_cores() == 64 and default_verify_threads(True) == 8


def test_loaders_of_one_size_share_the_process_verify_pool():
    a, b = (RowLoader("cpu", heads=2, head_dim=16, verify_threads=3) for _ in range(2))
    try:
        assert a._verify is b._verify is loader_mod.verify_pool(3)
        c = RowLoader("cpu", heads=2, head_dim=16, verify_threads=1)
        assert c._verify is None
        c.close()
    finally:
        a.close(), b.close()


def test_a_request_leaving_mid_step_with_verify_threads_frees_the_loader(entry):
    """Cancelled half-way (its request left the batch): its remaining loads are passed over, the loader thread
    finishes, and the next step's rows are right."""
    loader = RowLoader("cpu", heads=2, head_dim=16, ahead_blocks=1, verify_threads=3)
    try:
        jc = job(entry)
        reached = loader.start_step([(jc, 0)], lambda jc, b: [Y_ROWS])
        reached(0)
        loader.rows(jc, 0)(0, Y_ROWS)
        futures = list(jc.futures.values())
        RowLoader.cancel(jc)
        assert jc.futures == {}
        loader._pool.submit(lambda: None).result(timeout=10)  # the loader thread is past the cancelled step
        assert all(f.done() for f in futures) and sum(f.cancelled() for f in futures) >= BLOCKS - 3
        for b, got in enumerate(step_rows(loader, job(entry), 1)):
            torch.testing.assert_close(got, torch.from_numpy(entry.expected[1, b]), rtol=0, atol=0)
    finally:
        loader.close()


def test_a_broken_loader_loop_fails_its_loads_instead_of_leaving_them_waiting(entry, monkeypatch):
    """The loop itself raising (verify submissions refused, as at interpreter exit): every load it had not made
    ends in an error, so no block waits for it."""
    loader = RowLoader("cpu", heads=2, head_dim=16, verify_threads=3)
    real = loader._verify
    calls = []

    class Refusing:
        def submit(self, fn, *args):
            calls.append(args)
            if len(calls) > 2:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            return real.submit(fn, *args)

    monkeypatch.setattr(loader, "_verify", Refusing())
    try:
        jc = job(entry)
        loader.start_step([(jc, 0)], lambda jc, b: [Y_ROWS])
        futures = [jc.futures[(0, b, Y_ROWS)] for b in range(BLOCKS)]
        for f in futures:
            with pytest.raises(RuntimeError, match="the row loader stopped: cannot schedule"):
                f.result(timeout=10)
    finally:
        loader.close()


def test_preloaded_rows_carry_a_corrupt_chunk_to_the_block_that_reads_it(entry):
    """Calibration's loader loads a step's rows before it: a corrupt chunk fails that block's read, as the real
    loader's does, not the step's start."""
    loader = PreloadedRowLoader("cpu", heads=2, head_dim=16)
    try:
        corrupt(entry, 0, 3)
        got = step_rows(loader, job(entry), 0)
        assert isinstance(got[3], CorruptEntry)
        assert all(isinstance(g, torch.Tensor) for i, g in enumerate(got) if i != 3)
    finally:
        loader.close()
