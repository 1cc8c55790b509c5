"""STRENGTH and the activation cache (docs/caching.md, "Strength"): a STRENGTH < 1 edit runs the last steps of the
same schedule; a run at strength s records the steps it runs only. Flux Fill (this model) keys its entries on the
first step (its unmasked tokens' trajectory depends on it); families that blend the template back every step key
without it, and an entry recorded from an earlier step (a template run at strength 1) serves such an edit from the
rows at its own timesteps: that mechanism is checked here on Flux Fill's runtime with the keys made equal.

The runner is driven by hand (no loop thread) so which rows each step reads is exact."""

from dataclasses import replace

import numpy as np
import pytest

from maskedit import samples
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.families.flux_fill.cache import FluxCacheHooks
from maskedit.local import denoise_inputs
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from tests.conftest import atol, png

STEPS = 8


@pytest.fixture(scope="module")
def model(settings):
    return Preprocessor(settings), ModelRunner(settings)  # the keys do not depend on the store: one for all


@pytest.fixture()
def env(settings, tmp_path, model):
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    pre, base = model
    rt = CacheRuntime(FluxCacheHooks.of(base.transformer), store)
    runner = ModelRunner(settings, transformer=base.transformer, cache=rt)
    tpl = samples.template(256, 256, seed=41)

    def inputs(mask_seed: int, strength: float = 1.0, ratio: float = 0.2, register: bool = False):
        mask = samples.mask(256, 256, ratio, "blob", seed=mask_seed) if ratio else np.zeros((256, 256), np.uint8)
        params = parse_params(settings, "a scarf", steps=STEPS, strength=strength, register=register)
        return denoise_inputs(pre(png(tpl), png(mask), params))

    yield runner, rt, store, inputs
    rt.close()


def run(runner, rt, x) -> DenoiseJob:
    job = DenoiseJob(x)
    runner.prepare(job)
    while not job.done:
        runner.step([job])
    runner.release(job, ok=True)
    rt.flush()
    return job


def plain(runner, x):
    p = ModelRunner(runner.settings, transformer=runner.transformer)
    job = DenoiseJob(x)
    p.prepare(job)
    while not job.done:
        p.step([job])
    return job.result()


def test_the_first_step_is_in_a_flux_fill_key(env):
    runner, rt, store, inputs = env
    assert inputs(1, 0.5).cache_key != inputs(1, 1.0).cache_key
    assert inputs(1, 0.5).cache_key == inputs(1, 0.45).cache_key  # the same first step: the same schedule
    assert (inputs(1, 0.5).first_step, inputs(1, 0.45).first_step, inputs(1, 1.0).first_step) == (4, 4, 0)


def test_a_run_at_strength_s_records_its_steps_and_serves_the_same_edit_exactly(env):
    runner, rt, store, inputs = env
    x = inputs(2, 0.5)
    rec = run(runner, rt, x)
    assert rec.cache.status == "record" and rec.run_steps == 4
    entry = store.open(x.cache_key)
    assert entry.meta["first_step"] == 4 and entry.meta["steps"] == STEPS
    assert entry.tensor("y").shape[0] == 4  # rows for the steps it ran only
    again = run(runner, rt, x)
    assert again.cache.status == "hit" and again.cache.first == 4
    np.testing.assert_allclose(again.result(), plain(runner, x), atol=atol(runner.settings, 1e-5))


def test_a_strength_1_entry_serves_a_strength_s_edit_from_its_own_timesteps(env, monkeypatch):
    runner, rt, store, inputs = env
    key = run(runner, rt, inputs(3, 1.0, ratio=0, register=True)).inputs.cache_key
    read = []
    rows = rt.loader.rows
    monkeypatch.setattr(rt.loader, "rows", lambda jc, step: (read.append(step), rows(jc, step))[1])
    x = replace(inputs(4, 0.5), cache_key=key)  # as a blending family keys it
    hit = run(runner, rt, x)
    assert hit.cache.status == "hit" and hit.cache.first == 0
    assert read == [4, 5, 6, 7]  # the entry's rows at the edit's schedule steps (its timesteps)
    assert np.isfinite(hit.result()).all()
    # the same edit from a strength-0.5 template run of its own starts from the template's noised latents; the
    # strength-1 run's unmasked tokens reached that step from noise: close on a trained model, here only finite


def test_an_entry_from_a_later_step_does_not_serve_an_edit_starting_earlier_and_is_replaced(env):
    runner, rt, store, inputs = env
    key = inputs(5, 0.5).cache_key
    run(runner, rt, inputs(5, 0.5))
    x = replace(inputs(6, 1.0), cache_key=key)  # keys made equal, as a blending family's are
    full = run(runner, rt, x)
    assert full.cache.status == "record"  # the stored entry lacks its first steps: it records them all
    assert store.open(key).meta.get("first_step", 0) == 0
    later = run(runner, rt, replace(inputs(7, 0.75), cache_key=key))
    assert later.cache.status == "hit" and later.cache.first == 0 and later.first_step == 2
