"""Temporal reuse on FLUX.1 Kontext (``maskedit.temporal`` through FLUX.1's block hooks, over the image stream
``[noisy; reference]``): a request alone equals stock ``FluxKontextInpaintPipeline`` with Diffusers'
``apply_first_block_cache`` (reference image included), no reuse equals the plain path bit for bit, a plain request
and a reusing one in one call equal each alone, and a cache hit (reference rows from its entry) reuses on the masked
tokens it computes. With true classifier-free guidance (TRUE_CFG_SCALE and a negative prompt, ``true_cfg.apply``) the
negative prompt's call reuses on its own stream: a step mask alone equals the stock pipeline under cache-dit's
``enable_separate_cfg``, no reuse equals the plain guided path, and a guided reusing request beside an unguided one
(one call for the prompts, the negative call over the guided row only) equals each alone."""

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.hooks.hooks import CacheContext, _set_cache_context

from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.families.flux_kontext import FluxKontextFamily
from maskedit.families.flux_kontext.tiny import build

from .kontext_util import box_mask, job, kparams, load, runner, stock, template
from .temporal_util import (cached_with_reuse, check_a_hit_reuses, check_mixed_call_equals_each_alone,
                             check_no_reuse_is_plain, denoise_with_reuse)

STEPS = 6
MASK = {"policy": "steps", "steps": [0, 1, 3]}
PROMPT, SEED = "make the hat red", 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build(tmp_path_factory.mktemp("kontext-temporal") / "tiny", "kontext-tiny", seed=0)
    return d, FluxKontextFamily(d), load(d)


def jobs(model, n, reference=None):
    _, family, pipe = model
    return [job(family, pipe, template(seed=1), box_mask(), kparams(PROMPT, seed=SEED, steps=STEPS),
                reference=reference) for _ in range(n)]


def run(model, policies, reference=None):
    _, family, pipe = model
    return denoise_with_reuse(family, runner(pipe), jobs(model, len(policies), reference), policies)


def test_first_block_cache_alone_equals_stock_pipeline_with_diffusers_hook(model):
    d, _, _ = model
    ref = template(seed=9)
    (ours,) = run(model, [{"policy": "fbcache", "threshold": 0.3}], reference=ref)
    steps = ours.temporal.info()["temporal_steps"]
    assert "R" in steps and "C" in steps[1:], steps  # reused and computed steps both occur on this model
    theirs = load(d)  # its own transformer: the library's hooks on it
    apply_first_block_cache(theirs.transformer, FirstBlockCacheConfig(threshold=0.3))
    _set_cache_context(theirs.transformer, CacheContext("cond"))  # the pipeline names none; one for the whole call
    expected = stock(theirs, template(seed=1), box_mask(), PROMPT, SEED, STEPS, "latent", reference=ref)
    assert torch.equal(ours.latents, expected)


def test_no_reuse_equals_the_plain_path_bit_for_bit(model):
    check_no_reuse_is_plain(lambda policies: run(model, policies), STEPS)


def test_a_plain_and_a_reusing_request_in_one_call_equal_each_alone(model):
    check_mixed_call_equals_each_alone(lambda policies: run(model, policies), MASK, "CCRCRR")


def test_a_cache_hit_reuses_on_its_masked_tokens(model, tmp_path):
    """A hit computes its masked noisy tokens only (the reference rows come from its entry) and its residuals cover
    those; threshold 0 equals the hit without reuse bit for bit, and a reusing hit beside a plain hit in one call
    equals itself alone."""
    _, family, pipe = model
    rt = CacheRuntime(family.cache_hooks(pipe.transformer),
                      ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30))
    r = runner(pipe)

    def cached(policies, register=False):
        return cached_with_reuse(family, r, rt, jobs(model, len(policies)), policies, "kontext-t", register)

    try:
        _, reused = check_a_hit_reuses(cached, MASK, "CCRCRR")
        n_c = int(reused.inputs.token_mask.sum())
        assert int(reused.cache.idx_c.numel()) == n_c < reused.inputs.latents.shape[0]  # reference rows cached
    finally:
        rt.close()


TRUE_CFG = 4.0


def guided_jobs(model, flags: list) -> list:
    """Jobs with (True) or without (False) true classifier-free guidance (negative prompt "blurry")."""
    _, family, pipe = model
    out = []
    for g in flags:
        p = kparams(PROMPT, seed=SEED, steps=STEPS)
        p.true_cfg_scale, p.negative_prompt = (TRUE_CFG, "blurry") if g else (1.0, "")
        j = job(family, pipe, template(seed=1), box_mask(), p)
        j.inputs.true_cfg_scale = p.true_cfg_scale
        out.append(j)
    return out


def run_guided(model, policies, flags):
    _, family, pipe = model
    return denoise_with_reuse(family, runner(pipe), guided_jobs(model, flags), policies)


def test_true_cfg_negative_call_reuses_on_its_own_stream(model):
    (plain,) = run_guided(model, [None], [True])
    (zero,) = run_guided(model, [{"policy": "fbcache", "threshold": 0}], [True])
    assert zero.tensors.negative is not None and zero.temporal.info()["temporal_uncond_steps"] == "C" * STEPS
    assert torch.equal(zero.latents, plain.latents)
    (reused,) = run_guided(model, [MASK], [True])
    info = reused.temporal.info()
    assert info["temporal_steps"] == info["temporal_uncond_steps"] == "CCRCRR"
    assert not torch.equal(reused.latents, plain.latents)
    (other,) = run_guided(model, [None], [False])
    both = run_guided(model, [None, MASK], [False, True])
    assert both[0].temporal is None
    torch.testing.assert_close(both[0].latents, other.latents, atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1].latents, reused.latents, atol=1e-5, rtol=0)


def test_true_cfg_step_mask_alone_equals_stock_pipeline_with_cache_dit_separate_cfg(model):
    """Stock ``FluxKontextInpaintPipeline`` makes its negative call after the prompt's in every step and names no
    cache context: cache-dit's ``enable_separate_cfg=True`` (``cfg_compute_first=False``) gives that call its own
    state, as ours (Diffusers' hook would share one state between the two calls). Within 1e-5, not bit for bit: the
    plain guided path already differs from the stock one by float rounding (at most 1e-6 here, no reuse), while the
    reuse moves the result by about 5e-2."""
    import cache_dit
    from cache_dit import DBCacheConfig

    d, _, _ = model
    steps = [0, 1, 3]
    (ours,) = run_guided(model, [{"policy": "steps", "steps": steps}], [True])
    assert ours.temporal.info()["temporal_uncond_steps"] == "CCRCRR"
    theirs = load(d)
    cache_dit.enable_cache(theirs, cache_config=DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=0, residual_diff_threshold=0.0,
        enable_separate_cfg=True, cfg_compute_first=False, cfg_diff_compute_separate=True,
        steps_computation_mask=[1 if i in steps else 0 for i in range(STEPS)], steps_computation_policy="static",
        num_inference_steps=STEPS))
    expected = stock(theirs, template(seed=1), box_mask(), PROMPT, SEED, STEPS, "latent", true_cfg_scale=TRUE_CFG,
                     negative_prompt="blurry")
    torch.testing.assert_close(ours.latents, expected, atol=1e-5, rtol=0)
    (plain,) = run_guided(model, [None], [True])
    assert not torch.allclose(plain.latents, expected, atol=1e-3)  # the reuse changed the result
