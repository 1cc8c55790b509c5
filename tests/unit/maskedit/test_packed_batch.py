"""Requests of different resolutions share one transformer call per step (a packed call) and get exactly what
they would get alone, with and without the activation cache."""

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
from maskedit_lab.harness.baselines import PerResolutionRunner, cache_policy
from tests.conftest import atol, png

STEPS = 3


@pytest.fixture(scope="module")
def make(settings):
    pre = Preprocessor(settings)

    def make(w, h, seed, ratio, register=False):
        tpl, mask = samples.template(w, h, seed=seed), samples.mask(w, h, ratio, "blob", seed=seed)
        params = parse_params(settings, "a hat", steps=STEPS, register=register)
        return denoise_inputs(pre(png(tpl), png(mask), params))
    return make


def run_together(runner, inputs):
    """Admit every request at once and step them together to the end; count transformer calls per step."""
    calls = []
    handle = runner.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        jobs = [DenoiseJob(x) for x in inputs]
        for j in jobs:
            runner.prepare(j)
        per_step = []
        while not all(j.done for j in jobs):
            before = len(calls)
            runner.step([j for j in jobs if not j.done])
            per_step.append(len(calls) - before)
        for j in jobs:
            runner.release(j, True)
        return jobs, per_step
    finally:
        handle.remove()


def test_two_resolutions_share_one_call_and_match_solo_runs(runner, settings, make):
    square, wide = make(256, 256, 1, 0.2), make(320, 160, 2, 0.2)
    assert (square.model_w, square.model_h) != (wide.model_w, wide.model_h)
    packed = ModelRunner(settings, transformer=runner.transformer)
    jobs, per_step = run_together(packed, [square, wide])
    assert per_step == [1] * STEPS
    for job, x in zip(jobs, [square, wide]):
        (solo,), _ = run_together(packed, [x])
        np.testing.assert_allclose(job.result(), solo.result(), atol=atol(runner.settings, 1e-5))
    # The baseline keeps one call per resolution.
    _, per_step = run_together(PerResolutionRunner(settings, transformer=runner.transformer), [square, wide])
    assert per_step == [2] * STEPS


@pytest.mark.parametrize("policy", ["planner", "all_y", "all_kv"])
def test_cache_hit_and_template_run_of_other_sizes_pack_exactly(runner, settings, make, tmp_path, policy):
    """A hit on one template and the recording run of a template of another size, in one packed call, give the
    same latents and record the same activations as when each resolution has its own call."""
    results = {}
    for pack in (True, False):
        store = ActivationStore(tmp_path / f"{pack}mem", tmp_path / f"{pack}disk", 1 << 30, 1 << 30)
        rt = CacheRuntime(FluxCacheHooks.of(runner.transformer), store, policy=cache_policy(policy))
        r = (ModelRunner if pack else PerResolutionRunner)(settings, transformer=runner.transformer, cache=rt)
        try:
            run_together(r, [make(256, 256, 3, 0.0, register=True)])
            rt.flush()
            hit, record = make(256, 256, 3, 0.2), make(320, 160, 4, 0.1)
            jobs, per_step = run_together(r, [hit, record])
            rt.flush()
            assert [j.cache.status for j in jobs] == ["hit", "record"]
            assert per_step == [1 if pack else 2] * STEPS
            entry = store.open(record.cache_key)
            results[pack] = [j.result() for j in jobs], {k: entry.tensor(k).float().numpy() for k in ("y", "k", "v")}
        finally:
            rt.close()
    (lat_p, rec_p), (lat_s, rec_s) = results[True], results[False]
    for a, b in zip(lat_p, lat_s):
        np.testing.assert_allclose(a, b, atol=atol(runner.settings, 1e-5))
    for k in rec_p:
        assert rec_p[k].shape == rec_s[k].shape
        np.testing.assert_allclose(rec_p[k], rec_s[k], atol=atol(runner.settings, 1e-4))
