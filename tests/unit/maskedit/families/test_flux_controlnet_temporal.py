"""Temporal reuse with ControlNets (``flux_controlnet``): a reused step's middle residual carries the ControlNet
residuals its middle blocks received on the last computed step, and the first blocks take this step's (the
transformer adds them after every block; a reused row's middle blocks pass through and the last one is set to its
input plus the residual). No reuse equals the plain path bit for bit; requests with and without controls and
reuse in one call equal each alone. With true classifier-free guidance (TRUE_CFG_SCALE and a negative prompt,
requests without controls: ``FluxInpaintPipeline``'s, ``true_cfg.apply``) the negative prompt's call reuses on its own
stream: a step mask alone equals the stock pipeline under cache-dit's ``enable_separate_cfg``, no reuse equals the
plain guided path, and a guided reusing request beside an unguided one with controls equals each alone."""

import pytest
import torch

from .cn_util import GUIDANCE, MAX_SEQ, box_mask, edges, edit, job, params, prepared, spec, template, tiny_model
from .temporal_util import denoise_with_reuse

STEPS = 5
MASK = {"policy": "steps", "steps": [0, 1, 3]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("flux-cn-temporal") / "flux-cn-tiny", seed=0)


def run(model, requests):
    """``requests``: (controls, control images, seed, policy) each, stepped together as one group."""
    family, pipe, run_ = model
    jobs = [edit(family, pipe, run_, template(seed=9), box_mask(), specs, images, seed=seed, steps=STEPS)
            for specs, images, seed, _ in requests]
    return denoise_with_reuse(family, run_, jobs, [r[3] for r in requests])


def test_no_reuse_with_controls_equals_the_plain_path_bit_for_bit(model):
    c = ([spec("canny", 0.8)], [edges(seed=10)], 2)
    (plain,) = run(model, [c + (None,)])
    (zero,) = run(model, [c + ({"policy": "fbcache", "threshold": 0},)])
    assert torch.equal(zero.latents, plain.latents)


def test_mixed_calls_with_controls_and_reuse_equal_each_alone(model):
    requests = [((), (), 1, MASK), ([spec("canny", 0.8)], [edges(seed=10)], 2, MASK),
                ([spec("depth", 0.6, end=0.6)], [edges(seed=11)], 3, None)]
    alone = [run(model, [r])[0] for r in requests]
    assert alone[1].temporal.info()["temporal_steps"] == "CCRCR"
    together = run(model, requests)
    for x, y in zip(together, alone):
        torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=0)


TRUE_CFG = 4.0
PROMPT = "a red hat"


def guided(model, specs=(), images=(), seed=2, scale=TRUE_CFG):
    """A job with (``scale`` > 1: negative prompt "blurry") or without true classifier-free guidance."""
    family, pipe, run_ = model
    img, mask = template(seed=9), box_mask()
    p = params(PROMPT, seed=seed, steps=STEPS, controls=specs)
    p.true_cfg_scale, p.negative_prompt = (scale, "blurry") if scale > 1 else (1.0, "")
    prep, tokens, control_images = prepared(family, pipe, img, mask, p, images)
    j = job(run_, prep, tokens, control_images, specs, *img.size, STEPS)
    j.inputs.true_cfg_scale = p.true_cfg_scale
    return j


def run_guided(model, requests, policies):
    """``requests``: ``guided``'s keyword arguments each, stepped together as one group with ``policies``."""
    family, _, run_ = model
    return denoise_with_reuse(family, run_, [guided(model, **r) for r in requests], policies)


def test_true_cfg_no_reuse_equals_the_plain_guided_path_bit_for_bit(model):
    (plain,) = run_guided(model, [{}], [None])
    (zero,) = run_guided(model, [{}], [{"policy": "fbcache", "threshold": 0}])
    assert zero.tensors.negative is not None
    assert zero.temporal.info()["temporal_uncond_steps"] == "C" * STEPS
    assert torch.equal(zero.latents, plain.latents)


def test_true_cfg_reusing_request_beside_an_unguided_one_with_controls_equals_each_alone(model):
    """One call for the prompts (with and without ControlNet residuals), the negative call over the guided row only."""
    other = dict(specs=[spec("canny", 0.8)], images=[edges(seed=10)], seed=3, scale=1.0)
    (reused,) = run_guided(model, [{}], [MASK])
    assert reused.temporal.info()["temporal_uncond_steps"] == "CCRCR"
    (alone,) = run_guided(model, [other], [None])
    both = run_guided(model, [other, {}], [None, MASK])
    assert both[0].temporal is None and both[0].tensors.negative is None
    torch.testing.assert_close(both[0].latents, alone.latents, atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1].latents, reused.latents, atol=1e-5, rtol=0)


def test_true_cfg_step_mask_alone_equals_stock_pipeline_with_cache_dit_separate_cfg(model):
    """Stock ``FluxInpaintPipeline`` (a request without controls) makes its negative call after the prompt's in every
    step and names no cache context: cache-dit's ``enable_separate_cfg=True`` (``cfg_compute_first=False``) gives that
    call its own state, as ours. Within 1e-5 (test_flux_controlnet's parity tolerance), not bit for bit: the plain
    guided path already differs from the stock one by float rounding (at most 1e-6 here, no reuse), while the reuse
    moves the result by about 2e-2."""
    import cache_dit
    from cache_dit import DBCacheConfig
    from diffusers import FluxControlNetInpaintPipeline, FluxInpaintPipeline
    from PIL import Image

    family, _, _ = model
    steps = [0, 1, 3]
    (ours,) = run_guided(model, [{}], [{"policy": "steps", "steps": steps}])
    info = ours.temporal.info()
    assert info["temporal_steps"] == info["temporal_uncond_steps"] == "CCRCR"
    # a fresh copy: cache-dit patches the transformer it is given
    comps = FluxControlNetInpaintPipeline.from_pretrained(family.model_dir, controlnet=None).components
    theirs = FluxInpaintPipeline(**{k: v for k, v in comps.items() if k != "controlnet"}, image_encoder=None,
                                 feature_extractor=None)
    theirs.set_progress_bar_config(disable=True)
    cache_dit.enable_cache(theirs, cache_config=DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=0, residual_diff_threshold=0.0,
        enable_separate_cfg=True, cfg_compute_first=False, cfg_diff_compute_separate=True,
        steps_computation_mask=[1 if i in steps else 0 for i in range(STEPS)], steps_computation_policy="static",
        num_inference_steps=STEPS))
    img, mask = template(seed=9), box_mask()
    expected = theirs(prompt=PROMPT, negative_prompt="blurry", true_cfg_scale=TRUE_CFG, image=img,
                      mask_image=Image.fromarray(mask), height=256, width=256, strength=1.0,
                      num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQ,
                      generator=torch.Generator("cpu").manual_seed(2), output_type="latent").images
    torch.testing.assert_close(ours.latents, expected, atol=1e-5, rtol=0)
    (plain,) = run_guided(model, [{}], [None])
    assert not torch.allclose(plain.latents, expected, atol=1e-3)  # the reuse changed the result
