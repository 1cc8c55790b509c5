"""Temporal reuse on FLUX.1 Kontext (``maskedit.temporal`` through FLUX.1's block hooks, over the image stream
``[noisy; reference]``): a request alone equals stock ``FluxKontextInpaintPipeline`` with Diffusers'
``apply_first_block_cache`` (reference image included), no reuse equals the plain path bit for bit, a plain request
and a reusing one in one call equal each alone, and a cache hit (reference rows from its entry) reuses on the masked
tokens it computes."""

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.hooks.hooks import CacheContext, _set_cache_context

from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.families.flux_kontext import FluxKontextFamily
from maskedit.families.flux_kontext.tiny import build

from .kontext_util import box_mask, job, kparams, load, runner, stock, template
from .temporal_util import (cached_with_reuse, check_mixed_call_equals_each_alone, check_no_reuse_is_plain,
                             denoise_with_reuse)

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
        cached([MASK], register=True)
        (hit,), (zero,), (reused,) = cached([None]), cached([{"policy": "fbcache", "threshold": 0}]), cached([MASK])
        assert hit.cache.status == reused.cache.status == "hit"
        n_c = int(reused.inputs.token_mask.sum())
        assert int(reused.cache.idx_c.numel()) == n_c < reused.inputs.latents.shape[0]  # reference rows cached
        assert torch.equal(zero.latents, hit.latents)
        assert reused.temporal.info()["temporal_steps"] == "CCRCRR" and not torch.equal(reused.latents, hit.latents)
        both = cached([None, MASK])
        torch.testing.assert_close(both[0].latents, hit.latents, atol=1e-5, rtol=0)
        torch.testing.assert_close(both[1].latents, reused.latents, atol=1e-5, rtol=0)
    finally:
        rt.close()
