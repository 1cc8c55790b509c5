"""Temporal reuse on SD 2 / SDXL UNets (DeepCache-style, ``maskedit.families.unet_inpaint.temporal``): a request alone
equals the stock pipeline whose UNet reuses the same deep features (a plain reference of DeepCache: the output of
the last middle up block replaced by the one of the last computed step; Diffusers 0.42 has no DeepCache hook);
no reuse equals the plain path bit for bit; a plain request, a reusing one and a reusing cache hit in one batch
equal each alone; bad block counts name TEMPORAL."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit import samples
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.errors import InvalidInput
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit.local import LocalEditor, denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit.settings import load_settings
from tests.conftest import atol, png

STEPS = 5
SIZE = 128
COMPUTED = [0, 1, 3]
MASK = {"policy": "steps", "steps": COMPUTED, "fn": 1, "bn": 1}


@pytest.fixture(scope="module", params=["sd2-tiny", "sdxl-tiny"])
def unet(request, tmp_path_factory, settings):
    d = tmp_path_factory.mktemp(request.param) / "model"
    build_unet(d, request.param)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DTYPE": settings.dtype,
                       "MASKEDIT_DEVICE": settings.device})
    store_dir = tmp_path_factory.mktemp("store")
    store = ActivationStore(store_dir / "mem", store_dir / "disk", 1 << 30, 1 << 30)
    return request.param, s, Preprocessor(s, store=store), ModelRunner(s), store


def stock_with_deep_features_reused(name, s, tpl, mask, dtype, bn):
    """The stock inpainting pipeline; on a step outside ``COMPUTED`` its UNet's last middle up block returns the
    output it gave at the last computed step (the blocks feeding it still run: their results are then unused)."""
    from diffusers import DiffusionPipeline

    extra = {"safety_checker": None, "requires_safety_checker": False} if name.startswith("sd2") else {}
    pipe = DiffusionPipeline.from_pretrained(s.model_dir, dtype=dtype, **extra).to(s.torch_device)
    pipe.set_progress_bar_config(disable=True)
    state = {"step": -1, "kept": None}
    pipe.unet.register_forward_pre_hook(lambda m, a: state.update(step=state["step"] + 1))

    def deep(module, args, out):
        if state["step"] in COMPUTED:
            state["kept"] = out.clone()
            return out
        return state["kept"]

    pipe.unet.up_blocks[-bn - 1].register_forward_hook(deep)
    ref = pipe(prompt="a red hat", image=tpl, mask_image=Image.fromarray(mask), height=256, width=256,
               num_inference_steps=STEPS, guidance_scale=7.5, strength=1.0,
               generator=torch.Generator().manual_seed(5), output_type="latent").images[0]
    return ref.permute(1, 2, 0).reshape(-1, ref.shape[0]).float().cpu().numpy()


def test_a_request_alone_equals_the_stock_pipeline_reusing_the_same_deep_features(unet):
    name, s, *_ = unet
    tpl, mask = samples.template(SIZE, SIZE, seed=1), samples.mask(SIZE, SIZE, 0.25, "box", seed=1)
    ed = LocalEditor(s)
    try:
        _, p, job = ed.edit(png(tpl), png(mask), "a red hat", seed=5, steps=STEPS, guidance=7.5, raw_output=True,
                            template_seed=5, temporal=MASK)
        _, _, plain = ed.edit(png(tpl), png(mask), "a red hat", seed=5, steps=STEPS, guidance=7.5, raw_output=True,
                              template_seed=5)
    finally:
        ed.close()
    assert job.temporal.info()["temporal_steps"] == "CCRCR"
    assert not np.array_equal(job.result(), plain.result())
    ref = stock_with_deep_features_reused(name, s, tpl, mask, ed.runner.dtype, MASK["bn"])
    np.testing.assert_allclose(job.result(), ref, atol=atol(s, 1e-5), rtol=0)


def test_no_reuse_equals_the_plain_path_and_a_mixed_batch_equals_each_alone(unet):
    name, s, pre, runner, store = unet
    tpl = samples.template(SIZE, SIZE, seed=27)

    def x(mask, **kw):
        return denoise_inputs(pre(png(tpl), png(mask), parse_params(s, "a red hat", steps=STEPS, **kw)))

    rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store)
    eng = DenoiseEngine(ModelRunner(s, transformer=runner.transformer, cache=rt), max_batch=3)
    try:
        run_job(eng, x(np.zeros((SIZE, SIZE), np.uint8), register=True))
        rt.flush()
        m = samples.mask(SIZE, SIZE, 0.2, "box", seed=6)
        plain = replace(x(m), cache_key=None)
        zero = run_job(eng, replace(plain, temporal={"policy": "fbcache", "threshold": 0}))
        alone_plain = run_job(eng, plain)
        assert torch.equal(torch.from_numpy(zero.result()), torch.from_numpy(alone_plain.result()))
        reusing, hit = replace(plain, temporal=MASK), x(m, temporal=json.dumps(MASK))
        alone = [alone_plain, run_job(eng, reusing), run_job(eng, hit)]
        assert alone[2].cache.status == "hit" and alone[2].temporal.info()["temporal_steps"] == "CCRCR"
        done = []
        jobs = [DenoiseJob(j, on_done=done.append) for j in (plain, reusing, hit)]
        for j in jobs:
            eng.submit(j)
        import time

        t0 = time.time()
        while len(done) < 3 and time.time() - t0 < 180:
            time.sleep(0.05)
        assert len(done) == 3
        for j, ref in zip(jobs, alone):  # latents reach ~10 here; convolutions over 2, 4 or 6 rows round apart
            np.testing.assert_allclose(j.result(), ref.result(), atol=atol(s, 1e-4), rtol=0)
    finally:
        eng.shutdown()
        rt.close()


def test_a_hit_reusing_by_threshold_never_stalls_the_row_loader(unet):
    """A hit whose threshold policy reuses its middle blocks cancels their queued row loads after its first block.
    On SDXL's layout the first down block and the last up block hold no transformer blocks, so a reused step reports
    no block to the loader's window: the loader waited out its patience (1 s) on every cancelled load past the
    window, and the next steps queued behind them (12x a hit's time on ``sdxl-bench``). Counted, not timed."""
    name, s, pre, runner, store = unet
    tpl = samples.template(SIZE, SIZE, seed=31)

    def x(mask, **kw):
        return denoise_inputs(pre(png(tpl), png(mask), parse_params(s, "a red hat", steps=STEPS, **kw)))

    rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store)
    rt.loader.ahead_blocks = 1  # every UNet layout then has loads past the window on a reused step
    eng = DenoiseEngine(ModelRunner(s, transformer=runner.transformer, cache=rt))
    try:
        run_job(eng, x(np.zeros((SIZE, SIZE), np.uint8), register=True))
        rt.flush()
        m = samples.mask(SIZE, SIZE, 0.2, "box", seed=7)
        reuse = {"policy": "dbcache", "threshold": 1.0, "fn": 1, "bn": 1}  # reuses whenever it may
        jobs = [run_job(eng, x(m, temporal=json.dumps(reuse))) for _ in range(2)] + [run_job(eng, x(m))]
        assert all(j.cache.status == "hit" for j in jobs)
        assert "R" in jobs[0].temporal.info()["temporal_steps"]
        assert rt.loader.stalls == 0
    finally:
        eng.shutdown()
        rt.close()


def test_bad_block_counts_name_the_field(unet):
    name, s, pre, runner, store = unet
    tpl, m = samples.template(SIZE, SIZE, seed=2), samples.mask(SIZE, SIZE, 0.2, "box", seed=2)
    x = denoise_inputs(pre(png(tpl), png(m), parse_params(s, "x", steps=STEPS)))
    eng = DenoiseEngine(ModelRunner(s, transformer=runner.transformer))
    try:
        with pytest.raises(InvalidInput) as e:
            run_job(eng, replace(x, temporal={"policy": "steps", "steps": [0, 2], "fn": 1, "bn": 2}))
        assert e.value.field == "TEMPORAL" and "skip connections" in str(e.value)
    finally:
        eng.shutdown()
