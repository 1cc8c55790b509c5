"""Mask-aware, cached ControlNets on SDXL inpainting (``maskedit.cache.controlnet`` over the UNet's hooks): a template
run with controls records the ControlNets' transformer rows beside the UNet's, a hit computes masked rows in both and
equals the uncached ControlNet edit; keys cover the controls; windowed controls are cached over their active steps;
a step batch mixing hits, recordings and plain requests with other ControlNets equals each alone (sdxl-tiny, CPU)."""

import json
import threading
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest

from maskedit import samples
from maskedit.cache.controlnet import control_key
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.families import family_for
from maskedit.families.unet_inpaint import step as unet_step
from maskedit.families.unet_inpaint.cache import UNetCacheHooks
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit.local import LocalEditor, denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.settings import load_settings
from maskedit_lab.harness.baselines import cache_policy
from tests.conftest import atol, png

STEPS = 3
SIZE = 128
PROMPT = "a red hat"
EMPTY = np.zeros((SIZE, SIZE), np.uint8)
CANNY = [{"name": "canny", "scale": 0.8}]
# two controls, the second acting at step 1 of 3 only (0.3 .. 0.9 of the schedule)
WINDOWED = [{"name": "canny", "scale": 0.8}, {"name": "depth", "scale": 0.5, "start": 0.3, "end": 0.9}]
UNION = [{"name": "union", "scale": 0.7, "mode": "pose"}]  # ControlNetUnionModel: the same down path and mid block


@contextmanager
def editors(d, settings, preset):
    """(settings, a cached ``LocalEditor``, an uncached engine on its UNet, the store) for ``preset`` in ``d``."""
    build_unet(d / "model", preset)
    family_for(d / "model").build_controlnets(d / "model" / "controlnets", seed=0)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d / "model"), "MASKEDIT_DTYPE": settings.dtype,
                       "MASKEDIT_DEVICE": settings.device})
    store = ActivationStore(d / "mem", d / "disk", 1 << 30, 1 << 30)
    ed = LocalEditor(s, cache=lambda t: CacheRuntime(UNetCacheHooks.of(t), store, policy=cache_policy("planner")),
                     store=store)
    plain = DenoiseEngine(ModelRunner(s, transformer=ed.runner.transformer))  # no cache runtime: full compute
    try:
        yield s, ed, plain, store
    finally:
        plain.shutdown()
        ed.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory, settings):
    with editors(tmp_path_factory.mktemp("sdxl-cn-cache"), settings, "sdxl-tiny") as e:
        yield e


def controls_images(n, seed=7):
    return [samples.template(SIZE, SIZE, seed=seed + i) for i in range(n)]


def inputs(env, tpl, mask, spec, images, seed=5, register=False, **kw):
    s, ed, *_ = env
    params = parse_params(s, PROMPT, seed=seed, steps=STEPS, guidance=7.5, register=register,
                          controls=json.dumps(spec) if spec else None, **kw)
    return denoise_inputs(ed.pre(png(tpl), png(mask), params, [png(c) for c in images]))


def cached(env, x):
    _, ed, *_ = env
    job = run_job(ed.engine, x)
    ed.runner.cache.flush()
    return job


def uncached(env, x):
    return run_job(env[2], replace(x, cache_key=None)).result()


@pytest.mark.parametrize("spec", [CANNY, WINDOWED, UNION], ids=["one", "two-windowed", "union"])
def test_a_hit_with_controls_equals_the_uncached_controlnet_edit(env, spec):
    """The template's own mask: the hit computes the masked tokens in the UNet and in every ControlNet (the windowed
    one over its active step only) and reproduces the uncached edit."""
    hit_equals_uncached(env, spec)


def test_sd2_a_hit_with_controls_equals_the_uncached_controlnet_edit(tmp_path, settings):
    """SD 2 (no SDXL conditioning, three transformer levels) through the same path."""
    with editors(tmp_path, settings, "sd2-tiny") as env:
        hit_equals_uncached(env, WINDOWED)


def test_a_cropped_hit_with_controls_equals_the_uncached_cropped_controlnet_edit(env):
    """PADDING_MASK_CROP with ControlNets caches as without a crop: the key covers the box and the controls (the
    control images are cropped with the box), the first run records the UNet and both ControlNets, the next hits
    in all three and reproduces the uncached cropped edit."""
    s, ed, *_ = env
    tpl, mask = samples.template(SIZE, SIZE, seed=37), samples.mask(SIZE, SIZE, 0.2, "box", seed=3)
    params = parse_params(s, PROMPT, seed=5, steps=STEPS, guidance=7.5, controls=json.dumps(WINDOWED),
                          padding_mask_crop=8)
    p = ed.pre(png(tpl), png(mask), params, [png(c) for c in controls_images(2)])
    assert p.crop is not None and p.crop[2] - p.crop[0] < SIZE  # a crop smaller than the template: it matters
    x = hit_equals_uncached(env, WINDOWED, seed=37, padding_mask_crop=8)
    assert x.cache_key == p.cache_key != inputs(env, tpl, mask, WINDOWED, controls_images(2)).cache_key


def hit_equals_uncached(env, spec, seed=None, **kw):
    s, ed, plain, store = env
    tpl = samples.template(SIZE, SIZE, seed=seed or 31 + len(spec) + 5 * (spec is UNION))
    mask = samples.mask(SIZE, SIZE, 0.2, "box", seed=3)
    x = inputs(env, tpl, mask, spec, controls_images(len(spec)), **kw)
    first = cached(env, x)
    assert first.cache.status == "record" and [c.status for c in first.control_cache] == ["record"] * len(spec)
    assert all(c.recorder.complete for c in first.control_cache)  # a windowed control's entry: its active steps
    for k in range(len(spec)):
        assert store.locate(control_key(x.cache_key, k)) == "mem"
    ref = uncached(env, x)
    np.testing.assert_array_equal(first.result(), ref)  # recording changes nothing
    again = cached(env, x)
    masked = int(np.asarray(x.token_mask).sum())
    assert again.cache.status == "hit" and again.cache.idx_c.numel() == masked < x.latents.shape[0]
    assert [c.status for c in again.control_cache] == ["hit"] * len(spec)
    assert all(c.idx_c.numel() == masked and set(c.modes) - {"full"} for c in again.control_cache)
    np.testing.assert_allclose(again.result(), ref, atol=atol(s, 1e-5))
    assert np.abs(ref - uncached(env, replace(x, controls=()))).max() > 0.05  # the controls act on this edit
    return x


def test_without_its_residuals_a_hit_is_far_from_the_controlled_edit(env, monkeypatch):
    """Negative control: the same hit with the ControlNets' residuals left out of its UNet call (its masked rows
    computed without them) is far from the uncached ControlNet edit the hit above matches to 1e-5."""
    s, ed, *_ = env
    tpl, mask = samples.template(SIZE, SIZE, seed=41), samples.mask(SIZE, SIZE, 0.2, "box", seed=3)
    x = inputs(env, tpl, mask, CANNY, controls_images(1))
    cached(env, x)
    ref = uncached(env, x)
    monkeypatch.setattr(unet_step, "start_residuals", lambda provider, group, per_job: [None] * len(group))
    job = cached(env, x)
    assert job.cache.status == "hit"
    m = np.asarray(x.token_mask, bool)
    assert np.abs(job.result()[m] - ref[m]).max() > 0.05


@pytest.mark.parametrize("other", [
    [{"name": "canny", "scale": 0.5}], "image", [{"name": "canny", "scale": 0.8, "end": 0.6}],
    [{"name": "depth", "scale": 0.8}], None], ids=["scale", "image", "window", "controlnet", "none"])
def test_other_controls_are_a_miss_and_equal_their_own_run(env, other):
    s, ed, plain, store = env
    tpl, mask = samples.template(SIZE, SIZE, seed=50), samples.mask(SIZE, SIZE, 0.2, "box", seed=4)
    reg = inputs(env, tpl, EMPTY, CANNY, controls_images(1), register=True)
    cached(env, reg)
    spec, images = ((CANNY, controls_images(1, seed=99)) if other == "image"
                    else (other, controls_images(len(other or ()))))
    x = inputs(env, tpl, mask, spec, images)
    assert x.cache_key != reg.cache_key
    job = cached(env, x)
    assert job.cache.status == "record"  # never served from the entry recorded under other controls
    assert all(c.status == "record" for c in job.control_cache)
    np.testing.assert_array_equal(job.result(), uncached(env, x))


def test_a_mixed_step_batch_equals_each_request_alone(env):
    """One UNet call per step for: a request without controls, a ControlNet hit, a ControlNet recording (another
    template) and an uncached request with two other ControlNets (one union); each equals its run alone (the hit:
    its hit alone, the others: their uncached runs)."""
    s, ed, plain, store = env
    tpl, mask = samples.template(SIZE, SIZE, seed=60), samples.mask(SIZE, SIZE, 0.2, "box", seed=6)
    cached(env, inputs(env, tpl, EMPTY, CANNY, controls_images(1), register=True))
    xs = [replace(inputs(env, samples.template(SIZE, SIZE, seed=61), mask, None, [], seed=1), cache_key=None),
          inputs(env, tpl, mask, CANNY, controls_images(1), seed=2),
          inputs(env, samples.template(SIZE, SIZE, seed=62), mask, CANNY, controls_images(1), seed=3),
          replace(inputs(env, tpl, mask, [{"name": "depth", "scale": 0.6, "start": 0.4},
                                          {"name": "union", "scale": 0.7, "mode": "pose"}], controls_images(2),
                         seed=4), cache_key=None)]
    alone = [uncached(env, x) for x in xs]
    hit_alone = cached(env, xs[1])  # another mask than the registration's: the hit's own approximation, alone
    assert [c.status for c in hit_alone.control_cache] == ["hit"]
    alone[1] = hit_alone.result()
    eng = DenoiseEngine(ModelRunner(s, transformer=ed.runner.transformer, cache=ed.runner.cache), max_batch=4)
    try:
        done, finished = [], threading.Event()
        jobs = [DenoiseJob(x, on_done=lambda j: (done.append(j), len(done) == 4 and finished.set())) for x in xs]
        for j in jobs:
            eng.submit(j)
        assert finished.wait(120) and eng.max_running == 4
        ed.runner.cache.flush()
        assert [j.cache.status for j in jobs] == ["off", "hit", "record", "off"]
        assert [c.status for c in jobs[1].control_cache] == ["hit"]
        assert [c.status for c in jobs[2].control_cache] == ["record"]
        for j, ref in zip(jobs, alone):  # batched convolutions round differently (as the uncached mixed batch)
            np.testing.assert_allclose(j.result(), ref, atol=atol(s, 1e-4))
    finally:
        eng.shutdown()


def test_triton_placement_runs_requests_with_controls_uncached(env):
    """The ``controlnet`` Triton model computes the residuals out of the cache's reach: such requests are ``off``
    (and a request without controls still caches)."""
    s, ed, *_ = env
    runner = ModelRunner(replace(s, controlnet_placement="triton"), transformer=ed.runner.transformer,
                         cache=ed.runner.cache)
    tpl, mask = samples.template(SIZE, SIZE, seed=70), samples.mask(SIZE, SIZE, 0.2, "box", seed=7)
    with_controls, without = (DenoiseJob(inputs(env, tpl, mask, spec, controls_images(len(spec or ()))))
                              for spec in (CANNY, None))
    runner.decide(with_controls)
    runner.decide(without)
    assert with_controls.decision.status == "off" and without.decision.status == "record"
