"""The row loader: a step's rows reach the device in block order, verified, from verify threads or the loader's own."""

import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from maskedit.cache import entry_file
from maskedit.cache.integrity import CorruptEntry
from maskedit.cache.loader import Y_ROWS, RowLoader, default_verify_threads
from maskedit.cache.store import ActivationStore

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


def step_rows(loader, jc, step):
    """Run one step's blocks in order, as a model does: report each block, take its rows (or the error)."""
    reached = loader.start_step([(jc, step)], lambda jc, b: [Y_ROWS])
    get, out = loader.rows(jc, step), []
    for b in range(BLOCKS):
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
        assert loader.stalls == 0
    finally:
        loader.close()


def test_verification_runs_on_several_threads_ahead_of_the_copies(entry, monkeypatch):
    """With verify threads, the chunks of later blocks are hashed while the loader copies earlier ones: no chunk is
    copied before its own check, and the checks ran on more than one thread."""
    seen, order, mu = set(), [], threading.Lock()
    verify = entry.verify

    def spy(name, *index):
        with mu:
            seen.add(threading.current_thread().name)
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


def test_verify_threads_only_on_a_gpu():
    assert default_verify_threads(False) == 1
    assert 1 <= default_verify_threads(True) <= 8
