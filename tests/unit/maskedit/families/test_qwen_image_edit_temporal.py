"""Temporal reuse on Qwen-Image-Edit (``maskedit.temporal`` through the family's dual-stream block hooks, over the
image stream ``[noisy; reference]`` and the text): a request alone equals stock ``QwenImageEditInpaintPipeline`` with
Diffusers' ``apply_first_block_cache``, no reuse equals the plain path bit for bit, a plain request and a reusing one
in one call equal each alone, and a cache hit (reference rows from its entry) reuses on the masked tokens it computes.
With true classifier-free guidance the negative prompt's call reuses on its own stream (its own residuals, decisions
and TaylorSeer states): alone it equals the stock pipeline under Diffusers' hook (whose ``cache_context("uncond")``
keeps that call's state) and under cache-dit's ``enable_separate_cfg``, and no reuse equals the plain guided path."""

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore

from .qwen_util import box_mask, job, load, params, prepared, runner, stock, template, tiny_model
from maskedit_common.temporal import computed_fraction

from .temporal_util import (cached_with_reuse, check_a_hit_reuses, check_mixed_call_equals_each_alone,
                             check_no_reuse_is_plain, denoise_with_reuse)

STEPS = 6
MASK = {"policy": "steps", "steps": [0, 1, 3]}
PROMPT, SEED = "a red hat", 3
THRESHOLD = 0.45  # reused and computed steps both occur on this model (asserted): CRRCRC
GUIDED = dict(guidance=4.0, negative_prompt="blurry")  # true classifier-free guidance: a negative call per step
# Guided, the two calls' first-block changes differ by about 1e-3: at this threshold the prompt's call reuses CRRCRR
# and the negative prompt's CRRRCR (asserted), so a test that shares their state fails.
GUIDED_THRESHOLD = 0.6055


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, pipe = tiny_model(tmp_path_factory)
    preps = {}

    def jobs(n, guidance=1.0, negative_prompt=""):
        key = (guidance, negative_prompt)
        if key not in preps:
            preps[key] = prepared(family, pipe, template(seed=1), box_mask(),
                                  params(PROMPT, seed=SEED, steps=STEPS, guidance=guidance,
                                         negative_prompt=negative_prompt))
        prep, tokens, size = preps[key]
        return [job(prep, tokens, size, STEPS, guidance) for _ in range(n)]

    return family, pipe, jobs, tmp_path_factory.getbasetemp() / "qwen-edit-tiny"


def run(model, policies, **kw):
    family, pipe, jobs, _ = model
    return denoise_with_reuse(family, runner(family, pipe), jobs(len(policies), **kw), policies)


def test_first_block_cache_alone_equals_stock_pipeline_with_diffusers_hook(model):
    """The stock pipeline enters ``cache_context("cond")`` around its transformer call itself."""
    _, _, _, d = model
    policy = {"policy": "fbcache", "threshold": THRESHOLD}
    (ours,) = run(model, [policy])
    steps = ours.temporal.info()["temporal_steps"]
    assert steps == "CRRCRC", steps  # reused and computed steps both occur on this model
    theirs = load(d)  # its own transformer: the library's hooks on it
    apply_first_block_cache(theirs.transformer, FirstBlockCacheConfig(threshold=THRESHOLD))
    expected = stock(theirs, template(seed=1), box_mask(), PROMPT, SEED, STEPS, "latent")
    assert torch.equal(ours.latents, expected)
    (plain,) = run(model, [None])
    assert not torch.equal(ours.latents, plain.latents)  # the reuse changed the result


def test_no_reuse_equals_the_plain_path_bit_for_bit(model):
    check_no_reuse_is_plain(lambda policies: run(model, policies), STEPS)


def test_a_plain_and_a_reusing_request_in_one_call_equal_each_alone(model):
    check_mixed_call_equals_each_alone(lambda policies: run(model, policies), MASK, "CCRCRR")


def test_guided_first_block_cache_alone_equals_stock_pipeline_with_diffusers_hook(model):
    """A negative prompt (true_cfg_scale 4): both calls reuse, each on its own state, and the result equals the stock
    pipeline, which enters ``cache_context("cond")`` / ``cache_context("uncond")`` around its two calls (Diffusers'
    hook keeps one state per context). EDIT_INFO names both calls' steps and counts both in the computed fraction."""
    _, _, _, d = model
    policy = {"policy": "fbcache", "threshold": GUIDED_THRESHOLD}
    (ours,) = run(model, [policy], **GUIDED)
    assert ours.tensors.negative_embeds is not None
    info = ours.temporal.info()
    assert (info["temporal_steps"], info["temporal_uncond_steps"]) == ("CRRCRR", "CRRRCR"), info
    assert info["temporal_reused_steps"] == info["temporal_uncond_reused_steps"] == 4
    per_call = [computed_fraction(ours.temporal.spec, STEPS, 2, 4)] * 2  # 2 blocks, fn 1: a reused step computes 1
    assert info["temporal_computed_fraction"] == pytest.approx(sum(per_call) / 2) == pytest.approx(2 / 3)
    theirs = load(d)
    apply_first_block_cache(theirs.transformer, FirstBlockCacheConfig(threshold=GUIDED_THRESHOLD))
    expected = stock(theirs, template(seed=1), box_mask(), PROMPT, SEED, STEPS, "latent", **GUIDED)
    assert torch.equal(ours.latents, expected)
    (plain,) = run(model, [None], **GUIDED)
    assert not torch.equal(ours.latents, plain.latents)  # the reuse changed the result


def test_guided_no_reuse_equals_the_plain_guided_path_and_a_mixed_call_each_alone(model):
    """Guided: threshold 0 computes every step of both calls and equals the plain guided path bit for bit; a step
    mask reuses on both calls (each its own residuals) and, beside a guided request without reuse in one call, both
    equal themselves alone."""
    check_no_reuse_is_plain(lambda policies: run(model, policies, **GUIDED), STEPS)
    (zero,) = run(model, [{"policy": "fbcache", "threshold": 0}], **GUIDED)
    assert zero.temporal.info()["temporal_uncond_steps"] == "C" * STEPS
    assert zero.temporal.info()["temporal_computed_fraction"] == 1.0
    check_mixed_call_equals_each_alone(lambda policies: run(model, policies, **GUIDED), MASK, "CCRCRR")
    (reused,) = run(model, [MASK], **GUIDED)
    assert reused.temporal.info()["temporal_uncond_steps"] == "CCRCRR"
    (plain,) = run(model, [None], **GUIDED)
    assert plain.temporal is None


def test_a_cache_hit_reuses_on_its_masked_tokens(model, tmp_path):
    """A hit computes its masked noisy tokens only (the reference rows come from its entry) and its residuals cover
    those; threshold 0 equals the hit without reuse bit for bit, and a reusing hit beside a plain hit in one call
    equals itself alone."""
    family, pipe, jobs, _ = model
    rt = CacheRuntime(family.cache_hooks(pipe.transformer),
                      ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30))
    r = runner(family, pipe)

    def cached(policies, register=False):
        return cached_with_reuse(family, r, rt, jobs(len(policies)), policies, "qwen-t", register)

    try:
        _, reused = check_a_hit_reuses(cached, MASK, "CCRCRR")
        assert reused.temporal.active, reused.temporal.note
        n_c = int(reused.inputs.token_mask.sum())
        assert int(reused.cache.idx_c.numel()) == n_c < reused.inputs.latents.shape[0]  # reference rows cached
    finally:
        rt.close()


def test_a_zero_cond_t_model_refuses_temporal_reuse_by_name(model, monkeypatch):
    """Its blocks take per-token modulation, which the hooks' path for a reused step does not: refused at admission
    naming TEMPORAL, not failed mid-batch."""
    from types import SimpleNamespace

    from maskedit import temporal
    from maskedit.errors import InvalidInput

    family, pipe, jobs, _ = model
    hooks = family.temporal_hooks(pipe.transformer)
    monkeypatch.setattr(hooks, "transformer", SimpleNamespace(config=SimpleNamespace(zero_cond_t=True)))
    r = runner(family, pipe)
    r.family = family
    (j,) = jobs(1)
    j.inputs.temporal, j.temporal = MASK, None
    with pytest.raises(InvalidInput) as e:
        temporal.admit(r, j)
    assert e.value.field == "TEMPORAL" and "zero_cond_t" in str(e.value)


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    """The tiny preset with 4 blocks: with ``fn`` 1 and ``bn`` 1 two middle blocks are skipped and the last block
    computes on the text the reuse left (on 2 blocks the text a reused step carries is never read)."""
    from dataclasses import replace

    from maskedit.families.qwen_image_edit import QwenImageEditFamily
    from maskedit.families.qwen_image_edit.tiny import PRESETS, build

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "qwen-edit-tiny", replace(PRESETS["qwen-edit-tiny"], num_layers=4))
        d = build(tmp_path_factory.mktemp("qwen-4-blocks") / "tiny", "qwen-edit-tiny", seed=0)
    return QwenImageEditFamily(d), d


@pytest.mark.parametrize("bn", [0, 1])
@pytest.mark.parametrize("order", [0, 2], ids=["step-mask", "taylorseer-2"])
def test_dbcache_step_mask_with_last_blocks_equals_stock_pipeline_with_cache_dit(four_blocks, order, bn):
    """A step mask with ``fn`` 1 and ``bn`` 0 or 1 (and TaylorSeer order 2) alone equals stock
    ``QwenImageEditInpaintPipeline`` under cache-dit's ``enable_cache`` with the same DBCache settings; with ``bn`` 1
    the image and the text residuals both reach the last block (a reused step that drops the text residual fails
    it)."""
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    family, d = four_blocks
    pipe = load(d)
    steps = [0, 1, 3]
    policy = {"policy": "taylorseer", "order": order, "steps": steps, "fn": 1, "bn": bn} if order else \
        {"policy": "steps", "steps": steps, "fn": 1, "bn": bn}
    prep, tokens, size = prepared(family, pipe, template(seed=1), box_mask(), params(PROMPT, seed=SEED, steps=STEPS))
    (ours,) = denoise_with_reuse(family, runner(family, pipe), [job(prep, tokens, size, STEPS)], [policy])
    assert ours.temporal.info()["temporal_steps"] == "CCRCRR"
    theirs = load(d)
    extra = {"calibrator_config": TaylorSeerCalibratorConfig(taylorseer_order=order)} if order else {}
    cache_dit.enable_cache(theirs, cache_config=DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=bn, max_warmup_steps=0, residual_diff_threshold=0.0,
        enable_separate_cfg=False,  # the adapter assumes a second (CFG) call each step; this request makes none
        steps_computation_mask=[1 if i in steps else 0 for i in range(STEPS)], steps_computation_policy="static",
        num_inference_steps=STEPS), **extra)
    expected = stock(theirs, template(seed=1), box_mask(), PROMPT, SEED, STEPS, "latent")
    assert torch.equal(ours.latents, expected)
    (plain,) = denoise_with_reuse(family, runner(family, pipe), [job(prep, tokens, size, STEPS)], [None])
    assert not torch.allclose(ours.latents, plain.latents, atol=1e-4)  # the reuse changed the result


@pytest.mark.parametrize("order", [0, 2], ids=["step-mask", "taylorseer-2"])
def test_guided_dbcache_step_mask_equals_stock_pipeline_with_cache_dit_separate_cfg(four_blocks, order):
    """Guided (true_cfg_scale 4), a step mask at ``fn`` 1 / ``bn`` 1 (and TaylorSeer order 2) alone equals stock
    ``QwenImageEditInpaintPipeline`` under cache-dit's ``enable_cache`` with ``enable_separate_cfg=True`` (its Qwen
    adapter's default) and cache-dit's defaults for the negative call: ``cfg_compute_first=False`` (the prompt's call
    first, as the pipeline calls them), ``cfg_diff_compute_separate=True`` (its own decisions), the step mask read at
    the pipeline's step for both calls, and the negative call's own buffers and TaylorSeer calibrators."""
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    family, d = four_blocks
    pipe = load(d)
    steps = [0, 1, 3]
    policy = {"policy": "taylorseer", "order": order, "steps": steps, "fn": 1, "bn": 1} if order else \
        {"policy": "steps", "steps": steps, "fn": 1, "bn": 1}
    prep, tokens, size = prepared(family, pipe, template(seed=1), box_mask(),
                                  params(PROMPT, seed=SEED, steps=STEPS, **GUIDED))
    (ours,) = denoise_with_reuse(family, runner(family, pipe), [job(prep, tokens, size, STEPS, GUIDED["guidance"])],
                                 [policy])
    info = ours.temporal.info()
    assert info["temporal_steps"] == info["temporal_uncond_steps"] == "CCRCRR"
    theirs = load(d)
    extra = {"calibrator_config": TaylorSeerCalibratorConfig(taylorseer_order=order)} if order else {}
    cache_dit.enable_cache(theirs, cache_config=DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=0, residual_diff_threshold=0.0,
        enable_separate_cfg=True, cfg_compute_first=False, cfg_diff_compute_separate=True,
        steps_computation_mask=[1 if i in steps else 0 for i in range(STEPS)], steps_computation_policy="static",
        num_inference_steps=STEPS), **extra)
    expected = stock(theirs, template(seed=1), box_mask(), PROMPT, SEED, STEPS, "latent", **GUIDED)
    assert torch.equal(ours.latents, expected)
    (plain,) = denoise_with_reuse(family, runner(family, pipe), [job(prep, tokens, size, STEPS, GUIDED["guidance"])],
                                  [None])
    assert not torch.allclose(ours.latents, plain.latents, atol=1e-4)  # the reuse changed the result
