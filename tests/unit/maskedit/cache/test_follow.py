"""Requests on a template whose template run is still in progress follow it (read its rows from memory).

The runner is driven by hand (no loop thread) so which step each request joins at is exact."""

import numpy as np
import pytest

from maskedit import samples
from maskedit.families.flux_fill.cache import FluxCacheHooks
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.local import denoise_inputs
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from tests.conftest import atol, png

STEPS = 4


@pytest.fixture()
def env(settings, tmp_path):
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(settings, store=store)
    base = ModelRunner(settings)
    rt = CacheRuntime(FluxCacheHooks.of(base.transformer), store)
    runner = ModelRunner(settings, transformer=base.transformer, cache=rt)
    tpl = samples.template(256, 256, seed=31)

    def inputs(mask_seed: int, ratio: float = 0.2):
        params = parse_params(settings, "a scarf", steps=STEPS)
        return denoise_inputs(pre(png(tpl), png(samples.mask(256, 256, ratio, "blob", seed=mask_seed)), params))

    yield runner, rt, store, inputs
    rt.close()


def start(runner, x) -> DenoiseJob:
    job = DenoiseJob(x)
    runner.prepare(job)
    return job


def finish(runner, *jobs):
    while any(not j.done for j in jobs):
        runner.step([j for j in jobs if not j.done])
    for j in jobs:
        runner.release(j, ok=True)


def test_a_request_joining_after_the_template_run_follows_it_exactly(env):
    runner, rt, store, inputs = env
    x_rec, x = inputs(1), inputs(2)
    rec = start(runner, x_rec)
    assert rec.cache.status == "record" and rt.recording(x.cache_key)
    assert runner.estimate_tokens(DenoiseJob(x)) < x.latents.shape[0]  # counted as a hit before it starts
    runner.step([rec])
    follower = start(runner, x)  # joins one step behind the run
    jc = follower.cache
    assert jc.status == "hit" and jc.info()["cache_source"] == "live"
    finish(runner, rec, follower)
    rt.flush()
    assert jc.full_steps == 0 and not rt.recording(x.cache_key) and store.locate(x.cache_key)
    # The same request served from the saved entry computes the same thing.
    again = start(runner, x)
    assert again.cache.info()["cache_source"] == "store"
    finish(runner, again)
    np.testing.assert_allclose(follower.result(), again.result(), atol=atol(runner.settings, 1e-6))


def test_a_follower_admitted_with_the_run_computes_the_steps_it_lacks_in_full(env):
    runner, rt, store, inputs = env
    rec, follower = start(runner, inputs(3)), start(runner, inputs(4))  # same step: always level with it
    jc = follower.cache
    assert jc.status == "hit" and jc.live is rec.cache.recorder
    finish(runner, rec, follower)
    assert jc.full_steps == STEPS
    np.testing.assert_allclose(follower.result(), _plain(runner, inputs(4)), atol=atol(runner.settings, 1e-5))  # batched vs solo GEMMs


def test_a_follower_outlives_a_failed_template_run(env):
    runner, rt, store, inputs = env
    rec = start(runner, inputs(5))
    runner.step([rec])
    runner.step([rec])
    follower = start(runner, inputs(6))
    runner.step([rec, follower])  # the run has now recorded 3 steps; the follower used step 0's rows
    runner.release(rec, ok=False)  # cancelled: nothing is saved
    assert not rt.recording(inputs(6).cache_key)
    finish(runner, follower)  # steps 1-2 from the rows recorded before the run ended, step 3 in full
    rt.flush()
    assert follower.cache.full_steps == 1 and np.isfinite(follower.result()).all()
    assert store.locate(inputs(6).cache_key) is None


def _plain(runner, x):
    plain = ModelRunner(runner.settings, transformer=runner.transformer)
    job = start(plain, x)
    finish(plain, job)
    return job.result()


def test_requests_decided_before_a_template_run_hit_its_entry_once_it_is_stored(env):
    """A burst on a new template is decided all at once, before any of it runs: every request is a would-be template
    run then. Admitted later, after the first one's entry is stored, they must hit it, not record it again."""
    runner, rt, store, inputs = env
    first, later = DenoiseJob(inputs(7)), DenoiseJob(inputs(8))
    for j in (first, later):
        runner.decide(j)
    assert first.decision.status == later.decision.status == "record"
    runner.prepare(first)
    finish(runner, first)
    rt.flush()
    runner.prepare(later)
    assert later.cache.status == "hit" and later.cache.info()["cache_source"] == "store"
    finish(runner, later)
