"""The mask-aware engine on a CUDA GPU, in float32, bfloat16 and float16.

The CPU suite's engine and cache invariants (full mask = full computation; an empty mask on a cached template
replays the template run; cache off = miss; the same request replays identically; hits, template runs,
followers, heals, packed resolutions, noctx, cancels; latents equal to stock ``FluxFillPipeline``) run again on
the GPU in each dtype, within the stated tolerance (``tests/conftest.py``). The tests here add what only a GPU
has: page-locked loads on a copy stream, device-to-host recording on its own stream, no host synchronisation in
a cached step, entries in the model's dtype. With ``DEVICE=cpu`` (the dry run, ``tests/gpu/__init__.py``) the same
tests run on the CPU in float32 without those GPU-only checks, and the CPU suite is not run again (make test runs it).
"""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from maskedit import samples
from maskedit.families.flux_fill.cache import FluxCacheHooks
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.local import denoise_inputs
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit.settings import load_settings
from maskedit_lab.harness.baselines import FixedPolicy
from tests.conftest import atol, png

from . import DEVICE, DTYPES

ROOT = Path(__file__).resolve().parents[2]
UNIT_SUITE = ["tests/unit/maskedit/cache/test_invariants.py", "tests/unit/maskedit/cache/test_heal.py",
              "tests/unit/maskedit/cache/test_follow.py", "tests/unit/maskedit/test_packed_batch.py",
              "tests/unit/maskedit/test_engine.py", "tests/unit/maskedit/test_local_parity.py",
              "tests/unit/maskedit/cache/test_store_crash.py",
              "tests/unit/maskedit/test_unet_family.py"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cpu_suites_engine_invariants_hold_on_cuda(dtype):
    if DEVICE == "cpu":  # make test runs the suite on the CPU itself: the dry run checks that it is still there
        missing = [p for p in UNIT_SUITE if not (ROOT / p).is_file()]
        assert not missing, f"tests/gpu names suites that moved: {missing}"
        return
    env = {**os.environ, "MASKEDIT_DEVICE": DEVICE, "MASKEDIT_DTYPE": dtype}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *UNIT_SUITE],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


@pytest.fixture(scope="module", params=DTYPES)
def cuda_env(request, tmp_path_factory):
    s = load_settings({**os.environ, "MASKEDIT_DEVICE": DEVICE, "MASKEDIT_DTYPE": request.param})
    # The store in shared memory, as when serving (a file-backed mapping on another filesystem may not page-lock).
    d = Path(tempfile.mkdtemp(prefix=f"maskedit-gpu-{request.param}-", dir="/dev/shm"))
    store = ActivationStore(d / "mem", d / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(s, store=store)
    base = ModelRunner(s)
    rt = CacheRuntime(FluxCacheHooks.of(base.transformer), store, policy=FixedPolicy("all_kv"))
    runner = ModelRunner(s, transformer=base.transformer, cache=rt)
    tpl = samples.template(256, 256, seed=41)

    def inputs(ratio, seed, steps=3):
        params = parse_params(s, "a scarf", steps=steps)
        return denoise_inputs(pre(png(tpl), png(samples.mask(256, 256, ratio, "blob", seed=seed)), params))

    yield s, runner, rt, store, inputs
    rt.close()
    shutil.rmtree(d, ignore_errors=True)


def _run(runner, x, until=None):
    job = DenoiseJob(x)
    runner.prepare(job)
    while not job.done and (until is None or job.step_index < until):
        runner.step([job])
    return job


def test_entries_are_written_in_the_models_dtype_and_loaded_page_locked(cuda_env):
    s, runner, rt, store, inputs = cuda_env
    rec = _run(runner, inputs(0.2, 1))
    runner.release(rec, ok=True)
    rt.flush()
    entry = store.open(rec.inputs.cache_key)
    assert entry.tensor("y").dtype == runner.dtype and entry.tensor("k").dtype == runner.dtype
    assert rec.cache.recorder.y.is_pinned() or DEVICE == "cpu"
    hit = _run(runner, inputs(0.2, 2))
    jc = hit.cache
    assert jc.status == "hit" and "K" in jc.info()["block_modes"]
    assert entry.pinned or DEVICE == "cpu", \
        "the mapped entry should be registered with CUDA (DMA without a staging copy)"
    assert np.isfinite(hit.result()).all()
    runner.release(hit, ok=True)


def test_a_cached_step_never_synchronises_the_host(cuda_env):
    """Per-block work of a hit (loads, gathers, scatters, attention) queues on the GPU without a host sync."""
    s, runner, rt, store, inputs = cuda_env
    rec = _run(runner, inputs(0.3, 3))
    runner.release(rec, ok=True)
    rt.flush()
    hit = DenoiseJob(inputs(0.3, 4))
    runner.prepare(hit)
    runner.step([hit])  # the first step makes the cached row-index tensors (one copy each)
    with _host_syncs_fail():
        runner.step([hit])
    runner.release(hit, ok=True)


@contextlib.contextmanager
def _host_syncs_fail():
    """CUDA raises on any host synchronisation inside (on the CPU there is none to catch)."""
    if DEVICE == "cpu":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_follower_reads_the_recording_after_its_device_to_host_copies(cuda_env):
    s, runner, rt, store, inputs = cuda_env
    x_rec = inputs(0.2, 5, steps=4)
    rec = DenoiseJob(x_rec)
    runner.prepare(rec)
    runner.step([rec])
    follower = DenoiseJob(inputs(0.2, 6, steps=4))
    runner.prepare(follower)
    assert follower.cache.info()["cache_source"] == "live"
    while not (rec.done and follower.done):
        runner.step([j for j in (rec, follower) if not j.done])
    for j in (rec, follower):
        runner.release(j, ok=True)
    rt.flush()
    # The same request again, now from the stored entry: the follower read the very same rows.
    again = _run(runner, follower.inputs)
    np.testing.assert_allclose(again.result(), follower.result(), atol=atol(s, 1e-5))
    runner.release(again, ok=True)
