"""SD 2 and SDXL inpainting: the served stages equal stock Diffusers, and mask-aware caching in the UNet's
transformer blocks keeps the cache's invariants (the same ones the Flux tests check)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit import samples
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.families.unet_inpaint.cache import UNetCacheHooks, level_mask
from maskedit.denoise import ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.local import LocalEditor, denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit.settings import load_settings
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit_lab.harness.baselines import cache_policy
from tests.conftest import atol, exact_here, plain, png

STEPS = 3
SIZE = 128  # template pixels; the model runs at its preset's 256 x 256 (32 x 32 latents)


@pytest.fixture(scope="module", params=["sd2-tiny", "sdxl-tiny"])
def family(request, tmp_path_factory, settings):
    d = tmp_path_factory.mktemp(request.param) / "model"
    build_unet(d, request.param)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DTYPE": settings.dtype,
                       "MASKEDIT_DEVICE": settings.device})
    store_dir = tmp_path_factory.mktemp("store")
    store = ActivationStore(store_dir / "mem", store_dir / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(s, store=store)
    runner = ModelRunner(s)
    engines = {}

    def run(inputs, policy="planner"):
        if policy not in engines:
            rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store, policy=cache_policy(policy))
            engines[policy] = (DenoiseEngine(ModelRunner(s, transformer=runner.transformer, cache=rt)), rt)
        eng, rt = engines[policy]
        job = run_job(eng, inputs)
        rt.flush()
        return job

    yield request.param, s, pre, runner, run, store
    for eng, rt in engines.values():
        eng.shutdown()
        rt.close()


def prepared(pre, s, tpl, mask, **kw):
    params = parse_params(s, "a red hat", steps=STEPS, **kw)
    return denoise_inputs(pre(png(tpl), png(mask), params))


@pytest.mark.parametrize("guidance,negative", [(7.5, None), (7.5, "blurry, low quality"), (1.0, None)])
def test_latents_equal_the_stock_pipeline(family, guidance, negative):
    """The served stages (preprocess, UNet steps, decode) against ``StableDiffusion(XL)InpaintPipeline`` itself at
    strength 1 with the same components, seed, guidance (1.0: no classifier-free guidance) and negative prompt."""
    from diffusers import DiffusionPipeline

    name, s, *_ = family
    tpl, mask = samples.template(SIZE, SIZE, seed=1), samples.mask(SIZE, SIZE, 0.25, "box", seed=1)
    ed = LocalEditor(s)
    try:
        _, p, job = ed.edit(png(tpl), png(mask), "a red hat", seed=5, steps=STEPS, guidance=guidance,
                            raw_output=True, template_seed=5, negative_prompt=negative)
    finally:
        ed.close()
    extra = {"safety_checker": None, "requires_safety_checker": False} if name.startswith("sd2") else {}
    pipe = DiffusionPipeline.from_pretrained(s.model_dir, dtype=ed.runner.dtype, **extra).to(s.torch_device)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt="a red hat", image=tpl, mask_image=Image.fromarray(mask), height=p.model_h,
               width=p.model_w, num_inference_steps=STEPS, guidance_scale=guidance, strength=1.0,
               negative_prompt=negative,
               generator=torch.Generator().manual_seed(5), output_type="latent").images[0]
    ref = ref.permute(1, 2, 0).reshape(-1, ref.shape[0]).float().cpu().numpy()
    if exact_here(s):
        np.testing.assert_array_equal(job.result(), ref)
    else:
        np.testing.assert_allclose(job.result(), ref, atol=atol(s, 0))


def test_blocks_and_levels(family):
    """Every transformer block of the UNet is hooked, in execution order, at the level whose grid it really sees."""
    from diffusers.models.attention import BasicTransformerBlock

    name, s, pre, runner, *_ = family
    unet = runner.transformer
    hooks = UNetCacheHooks.of(unet)
    assert len(hooks.blocks) == sum(isinstance(m, BasicTransformerBlock) for m in unet.modules())
    seen = []
    handles = [blk.register_forward_pre_hook(lambda m, args, kw: seen.append((m, args[0].shape[1])), with_kwargs=True)
               for blk in hooks.blocks]
    try:
        x = prepared(pre, s, samples.template(SIZE, SIZE, seed=2), samples.mask(SIZE, SIZE, 0.2, "box", seed=2))
        plain(runner, replace(x, steps=1))
    finally:
        for h in handles:
            h.remove()
    grid = (x.model_h // 8, x.model_w // 8)
    shapes = hooks.shapes(grid)
    assert [m for m, _ in seen[:len(hooks.blocks)]] == hooks.blocks
    assert [n for _, n in seen[:len(hooks.blocks)]] == [shapes[b][0] for b in range(len(hooks.blocks))]
    assert len(set(hooks.levels)) >= 2 and hooks.group_last[-1]
    m = np.zeros((8, 8), bool)
    m[0, 0] = True
    pooled = level_mask(m.reshape(-1), (8, 8), 1).reshape(4, 4)
    assert pooled[0, 0] and pooled.sum() == 1


def test_record_then_same_mask_reproduces_the_template_run(family):
    name, s, pre, runner, run, store = family
    tpl, mask = samples.template(SIZE, SIZE, seed=21), samples.mask(SIZE, SIZE, 0.2, "box", seed=21)
    x = prepared(pre, s, tpl, mask)
    first = run(x)
    assert first.cache.status == "record" and store.locate(x.cache_key) == "mem"
    assert first.cache.recorder.complete
    np.testing.assert_array_equal(first.result(), plain(runner, x).result())  # recording changes nothing
    for policy in ("planner", "all_y", "all_kv"):
        again = run(x, policy)
        jc = again.cache
        assert jc.status == "hit" and jc.idx_c.numel() == int(np.asarray(x.token_mask).sum())
        assert set(jc.modes) - {"full"}, jc.modes  # some blocks really took rows from the store
        np.testing.assert_allclose(again.result(), first.result(), atol=atol(s, 1e-5))


def test_full_mask_is_full_computation(family):
    name, s, pre, runner, run, store = family
    tpl = samples.template(SIZE, SIZE, seed=22)
    run(prepared(pre, s, tpl, samples.mask(SIZE, SIZE, 0.1, "blob", seed=1), register=True))
    x = prepared(pre, s, tpl, np.full((SIZE, SIZE), 255, np.uint8))
    job = run(x)
    assert job.cache.status == "full"
    np.testing.assert_array_equal(job.result(), plain(runner, x).result())


def test_empty_mask_on_a_cached_template_is_the_template_run(family):
    name, s, pre, runner, run, store = family
    tpl = samples.template(SIZE, SIZE, seed=23)
    reg = prepared(pre, s, tpl, np.zeros((SIZE, SIZE), np.uint8), register=True)
    template_run = run(reg)
    job = run(replace(reg, register=False))
    assert job.cache.status == "hit" and job.cache.idx_c.numel() == 0
    np.testing.assert_allclose(job.result(), template_run.result(), atol=atol(s, 1e-6))


def test_new_mask_uses_the_cached_context(family):
    """A hit for another mask approximates the full computation better than dropping the cached context."""
    name, s, pre, runner, run, store = family
    tpl = samples.template(SIZE, SIZE, seed=25)
    run(prepared(pre, s, tpl, np.zeros((SIZE, SIZE), np.uint8), register=True))
    x = prepared(pre, s, tpl, samples.mask(SIZE, SIZE, 0.2, "blob", seed=5))
    full = plain(runner, x).result()
    m = np.asarray(x.token_mask, bool)
    err = {}
    for policy in ("all_y", "noctx"):
        job = run(x, policy)
        assert job.cache.status == "hit"
        err[policy] = float(np.abs(job.result()[m] - full[m]).mean())
    assert err["all_y"] < err["noctx"], err


def test_batched_requests_equal_their_runs_alone(family):
    """Continuous batching: two requests (one a cache hit, one plain, different guidance rows) share steps."""
    name, s, pre, runner, run, store = family
    tpl = samples.template(SIZE, SIZE, seed=27)
    run(prepared(pre, s, tpl, np.zeros((SIZE, SIZE), np.uint8), register=True))
    a = prepared(pre, s, tpl, samples.mask(SIZE, SIZE, 0.2, "box", seed=6))
    b = replace(prepared(pre, s, samples.template(SIZE, SIZE, seed=28), samples.mask(SIZE, SIZE, 0.3, "blob", seed=7),
                         guidance=1.0), cache_key=None)
    alone = [run(a, "all_y").result(), plain(runner, b).result()]
    rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store, policy=cache_policy("all_y"))
    eng = DenoiseEngine(ModelRunner(s, transformer=runner.transformer, cache=rt), max_batch=2)
    try:
        from maskedit.denoise import DenoiseJob

        done = []
        jobs = [DenoiseJob(x, on_done=done.append) for x in (a, b)]
        for j in jobs:
            eng.submit(j)
        import time

        t0 = time.time()
        while len(done) < 2 and time.time() - t0 < 120:
            time.sleep(0.05)
        assert len(done) == 2 and eng.max_running == 2
        assert jobs[0].cache.status == "hit"
        for j, ref in zip(jobs, alone):
            np.testing.assert_allclose(j.result(), ref, atol=atol(s, 1e-5))
    finally:
        eng.shutdown()
        rt.close()


def test_a_request_joining_after_the_template_run_follows_it(family, tmp_path):
    """A hit on a template whose run is still in progress reads the run's rows from memory (both guidance rows,
    every block's own size), and computes what the saved entry would give it."""
    from maskedit.denoise import DenoiseJob

    name, s, pre, runner, run, _ = family
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store, policy=cache_policy("all_y"))
    r = ModelRunner(s, transformer=runner.transformer, cache=rt)
    tpl = samples.template(SIZE, SIZE, seed=33)
    x_rec = prepared(pre, s, tpl, samples.mask(SIZE, SIZE, 0.1, "box", seed=8))
    x = prepared(pre, s, tpl, samples.mask(SIZE, SIZE, 0.2, "blob", seed=9))

    def start(inputs):
        job = DenoiseJob(inputs)
        r.prepare(job)
        return job

    def finish(*jobs):
        while any(not j.done for j in jobs):
            r.step([j for j in jobs if not j.done])
        for j in jobs:
            r.release(j, ok=True)

    try:
        rec = start(x_rec)
        assert rec.cache.status == "record"
        r.step([rec])
        follower = start(x)
        assert follower.cache.info()["cache_source"] == "live"
        finish(rec, follower)
        rt.flush()
        assert follower.cache.full_steps == 0 and store.locate(x.cache_key)
        again = start(x)
        assert again.cache.info()["cache_source"] == "store"
        finish(again)
        # The follower shared its UNet calls with the run (a batch of 4 rows, convolutions included), the second
        # hit ran alone: batched vs solo kernels, not the cache, differ in the last bits.
        np.testing.assert_allclose(follower.result(), again.result(), atol=atol(s, 1e-4))
    finally:
        rt.close()


def test_a_hit_heals_the_pixels_the_template_run_edited(family):
    """An entry recorded by an edit holds that edit's pixels invalid at every level; a hit that leaves them
    outside its own cells computes them as template context and rewrites the entry with its rows for them, block by
    block at each block's level, so the hits after it compute only their own pixels and get the same result."""
    from maskedit_common.heal import cells

    name, s, pre, runner, run, store = family
    tpl = samples.template(SIZE, SIZE, seed=35)
    side = np.zeros((SIZE, SIZE), np.uint8)
    left, right = side.copy(), side.copy()
    left[:, :SIZE // 4], right[:, -SIZE // 4:] = 255, 255  # a quarter each, at opposite edges
    xl, xr = prepared(pre, s, tpl, left), prepared(pre, s, tpl, right)
    assert run(xl, "all_y").cache.status == "record"
    before = store.open(xl.cache_key)
    hooks = UNetCacheHooks.of(runner.transformer)
    own_l, own_r = np.asarray(xl.token_mask, bool), np.asarray(xr.token_mask, bool)
    grid = (xl.model_h // 8, xl.model_w // 8)
    assert not (cells(own_r, grid, hooks.coarsest) & own_l).any()  # the masks share no cell at any level

    heals = store.stats.heals
    hit = run(xr, "all_y")
    jc = hit.cache
    assert jc.status == "hit" and jc.info()["healed_tokens"] == own_l.sum() and jc.patch.complete
    assert store.stats.heals == heals + 1
    healed = store.open(xl.cache_key)
    assert healed is not before and np.asarray(healed.arrays["valid"]).all()
    for array in set(before.arrays) - {"valid"}:  # rows off the edit's tokens keep the template run's bits
        keep = ~level_mask(own_l, grid, hooks.levels[int(array.split(".")[1])])  # y.<b>: block b's level
        np.testing.assert_array_equal(healed.arrays[array][:, :, keep], before.arrays[array][:, :, keep])
        assert not np.array_equal(healed.arrays[array][:, :, ~keep], before.arrays[array][:, :, ~keep])

    again = run(xr, "all_y")
    assert again.cache.status == "hit" and again.cache.computed.sum() == own_r.sum() and again.cache.patch is None
    np.testing.assert_allclose(again.result(), hit.result(), atol=atol(s, 1e-5))


@pytest.mark.parametrize("name", ["EulerAncestralDiscreteScheduler", "PNDMScheduler"])
def test_a_scheduler_that_cannot_batch_deterministically_is_refused_at_start(name):
    from maskedit.families.unet_inpaint.prepare import check_unet_scheduler

    cfg = {"_class_name": name, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
           "num_train_timesteps": 1000, "steps_offset": 1, "skip_prk_steps": True}
    with pytest.raises(ValueError, match=name):
        check_unet_scheduler(cfg)
    check_unet_scheduler({**cfg, "_class_name": "EulerDiscreteScheduler"})
