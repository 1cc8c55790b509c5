"""The qwen_image_edit family reproduces stock ``QwenImageEditInpaintPipeline`` exactly (float32, CPU), batched or
not, with and without true classifier-free guidance; its sizing, seeds, prompt cache and tensor slots."""

import numpy as np
import pytest
import torch
from PIL import Image
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint import calculate_dimensions

from maskedit.errors import InvalidInput
from maskedit.families.qwen_image_edit import prepare as P
from maskedit.families.qwen_image_edit.prompt_cache import EncodedPrompts
from maskedit.families.qwen_image_edit.step import text_lengths

from .qwen_util import (SIZE, box_mask, job, params, prepared, run, runner, settings, stock, template,
                        tiny_model)

STEPS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def test_two_batched_requests_equal_the_stock_pipeline(model):
    family, pipe = model
    img, mask = template(seed=1), box_mask()
    cases = ((3, "a red hat"), (7, "a blue hat"))  # prompts of one length: the two share every call
    jobs = []
    for seed, prompt in cases:
        prep, tokens, size = prepared(family, pipe, img, mask, params(prompt, seed=seed, steps=STEPS))
        jobs.append(job(prep, tokens, size, STEPS))
    out = run(family, runner(family, pipe), jobs)
    for latents, (seed, prompt) in zip(out, cases):
        assert torch.equal(latents, stock(pipe, img, mask, prompt, seed, STEPS))
    ours = np.asarray(family.decode(pipe, out[0], SIZE, SIZE))
    np.testing.assert_array_equal(ours, np.asarray(stock(pipe, img, mask, "a red hat", 3, STEPS, "pil")[0]))


def test_guided_requests_batched_equal_the_stock_pipeline(model):
    """true_cfg_scale 4 with a negative prompt: a second call per step and the norm-rescaled combination."""
    family, pipe = model
    img, mask = template(seed=2), box_mask(box=(128, 64, 512, 448))
    cases = ((5, "a red hat"), (6, "a green jacket"))
    jobs = []
    for seed, prompt in cases:
        prep, tokens, size = prepared(family, pipe, img, mask, params(prompt, seed=seed, steps=2, guidance=4.0,
                                                                      negative_prompt="blurry"))
        assert prep.pooled_embeds[1] > 0  # the negative prompt's rows ride along
        jobs.append(job(prep, tokens, size, 2, guidance=4.0))
    out = run(family, runner(family, pipe), jobs)
    for latents, (seed, prompt) in zip(out, cases):
        ref = stock(pipe, img, mask, prompt, seed, 2, guidance=4.0, negative_prompt="blurry")
        assert torch.equal(latents, ref)
    unguided = stock(pipe, img, mask, "a red hat", 5, 2)
    assert not torch.allclose(out[0], unguided, atol=1e-3), "guidance changed nothing"


def test_one_request_equals_stock_at_another_aspect_ratio(model):
    family, pipe = model
    img, mask = template(1300, 840, seed=3), box_mask(1300, 840, (100, 200, 500, 900))
    prep, tokens, size = prepared(family, pipe, img, mask, params(seed=11, steps=2))
    assert size == (1280, 832)  # calculate_dimensions(1024**2, 1300 / 840), as the pipeline sizes it
    (latents,) = run(family, runner(family, pipe), [job(prep, tokens, size, 2)])
    assert torch.equal(latents, stock(pipe, img, mask, "a red hat", 11, 2))


def test_model_size_is_the_pipelines_own():
    """The real model (16 px tokens): exactly ``calculate_dimensions`` of 1024**2 at the aspect ratio."""
    for w, h in ((1024, 1024), (1920, 1080), (600, 1400), (3000, 1000), (777, 555)):
        cw, ch, _ = calculate_dimensions(1024 * 1024, w / h)
        assert P.model_size(w, h, 1024, 16) == (cw // 16 * 16, ch // 16 * 16) == (cw, ch)


def test_tensor_slots_and_seed_varies_only_the_masked_noise(model):
    family, pipe = model
    img, mask = template(seed=4), box_mask()
    a, tokens, _ = prepared(family, pipe, img, mask, params(seed=1, template_seed=0))
    b, _, _ = prepared(family, pipe, img, mask, params(seed=2, template_seed=0))
    own, _, _ = prepared(family, pipe, img, mask, params(seed=2, template_seed=2))
    c = pipe.latent_channels * 4
    n = (SIZE // family.geometry().patch) ** 2
    assert a.latents.shape == (n, c) and a.cond.shape == (n, 3 * c) and a.pooled_embeds.tolist() == [
        a.prompt_embeds.shape[0], 0]
    m = torch.from_numpy(tokens)
    assert torch.equal(a.latents[~m], b.latents[~m]) and not torch.equal(a.latents[m], b.latents[m])
    ref_a, noise_a, blend = P.split_cond(a.cond, c)
    ref_b, noise_b, _ = P.split_cond(b.cond, c)
    assert torch.equal(ref_a, ref_b) and torch.equal(noise_a[~m], noise_b[~m])
    # The masked tokens' noise is what the pipeline draws with SEED (after the VAE's sample draw).
    assert torch.equal(noise_b[m], P.split_cond(own.cond, c)[1][m])
    assert torch.equal(a.latents, noise_a)  # strength 1.0: the first sigma is 1, latents are the noise
    assert float(blend[~m].abs().max()) == 0.0 and float(blend[m].max()) == 1.0  # blend > 0 only where masked


def test_the_encoders_image_round_trips_exactly(model):
    """The VL encoder gets the template as the pipeline's image processor sees it, rebuilt from its tensor."""
    from PIL import Image

    _, pipe = model
    values = np.arange(256, dtype=np.uint8)
    img = Image.fromarray(np.stack([values.reshape(16, 16)] * 3, axis=-1).repeat(4, 0).repeat(4, 1))
    tensor = pipe.image_processor.preprocess(img, height=64, width=64)
    np.testing.assert_array_equal(np.asarray(P.prompt_image(pipe, tensor)), np.asarray(img))


def test_encoded_prompts_are_cached_per_prompt_and_template(model):
    family, pipe = model
    s = settings()
    cache = family.prompt_cache(s)
    img, other = template(seed=5), template(seed=6)
    first, _, _ = prepared(family, pipe, img, box_mask(), params("a red cap", seed=1), s)
    hits, misses = cache.hits, cache.misses
    again, _, _ = prepared(family, pipe, img, box_mask(), params("a red cap", seed=2), s)
    assert (cache.hits, cache.misses) == (hits + 1, misses)
    assert torch.equal(again.prompt_embeds, first.prompt_embeds)
    elsewhere, _, _ = prepared(family, pipe, other, box_mask(), params("a red cap", seed=1), s)
    assert cache.misses == misses + 1  # the encoding reads the template: another template is another entry
    assert not torch.equal(elsewhere.prompt_embeds, first.prompt_embeds)


def test_encoded_prompt_cache_stays_within_its_bytes():
    from PIL import Image

    cache = EncodedPrompts(max_bytes=3 * 400)
    img = Image.new("RGB", (8, 8))
    calls = []
    for i in range(5):
        cache.get(f"p{i}", img, lambda: calls.append(1) or torch.zeros(100))  # 400 bytes each
    assert len(cache) == 3 and cache.nbytes == 1200 and len(calls) == 5
    cache.get("p0", img, lambda: calls.append(1) or torch.zeros(100))  # evicted (least recently used)
    cache.get("p4", img, lambda: calls.append(1) or torch.zeros(100))  # kept
    assert len(calls) == 6
    cache.get("huge", img, lambda: torch.zeros(1000))  # larger than the whole budget: not kept
    assert len(cache) == 3 and cache.nbytes <= 1200


def test_bad_text_row_counts_are_refused_by_name():
    with pytest.raises(InvalidInput) as e:
        text_lengths(np.array([10.0, 3.0], np.float32), 12)
    assert e.value.field == "POOLED_EMBEDS"
    for bad in (np.array([np.nan, 3.0], np.float32), np.zeros(3, np.float32)):
        with pytest.raises(InvalidInput):
            text_lengths(bad, 12)
    assert text_lengths(np.array([9.0, 3.0], np.float32), 12) == (9, 3)


def test_one_step_is_refused_by_name(model):
    """The scheduler's terminal stretch divides by zero for one step (stock returns NaN): refused, naming STEPS."""
    family, pipe = model
    with pytest.raises(InvalidInput) as e:
        prepared(family, pipe, template(), box_mask(), params(steps=1))
    assert e.value.field == "STEPS"


def test_real_size_preset_is_qwen_image_edit_sized(tmp_path):
    """The transformer's exact configuration, generated on the serving device (here: meta) in the serving dtype;
    the stand-in encoder and VAE load with stock Diffusers at the real interface widths."""
    import json

    from maskedit.components import load_pipeline, load_transformer
    from maskedit.settings import load_settings
    from maskedit.build_model import build

    d = build(tmp_path / "qwen-image-edit", "qwen-image-edit")
    cfg = json.loads((d / "transformer" / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels",
                                "out_channels", "joint_attention_dim", "axes_dims_rope", "guidance_embeds")} == {
        "num_layers": 60, "num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 64,
        "out_channels": 16, "joint_attention_dim": 3584, "axes_dims_rope": [16, 56, 56], "guidance_embeds": False}
    assert not list((d / "transformer").glob("*.safetensors"))  # nothing generated is written
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DEVICE": "meta", "MASKEDIT_DTYPE": "bfloat16"})
    assert (s.resolution, s.steps, s.guidance) == (1024, 50, 4.0)
    model = load_transformer(s)
    assert 20.3e9 < sum(p.numel() for p in model.parameters()) < 20.5e9
    assert all(p.dtype == torch.bfloat16 and p.device.type == "meta" for p in model.parameters())
    pipe = load_pipeline(load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DEVICE": "cpu"}))
    assert pipe.text_encoder.config.text_config.hidden_size == 3584 and pipe.vae_scale_factor == 8


@pytest.mark.parametrize("strength", [0.1, 0.45])
def test_strength_equals_the_stock_pipeline(model, strength):
    """STRENGTH: the schedule's last steps from the template noised to the first (``get_timesteps``), as the
    engine runs them (a job starting at that step, its scheduler's begin index there)."""
    from maskedit.schedule import first_step

    family, pipe = model
    img, mask = template(seed=5), box_mask()
    p = params(seed=3, steps=10)
    p.strength = strength
    prep, tokens, size = prepared(family, pipe, img, mask, p)
    j, run_ = job(prep, tokens, size, 10), runner(family, pipe)
    first = first_step(type(pipe), 10, strength)
    family.prepare_job(run_, j)
    j.scheduler.set_begin_index(first)
    j.step_index = first
    with torch.no_grad():
        while j.step_index < j.steps:
            family.step(run_, [j], None)
    ref = pipe(image=img, prompt="a red hat", mask_image=Image.fromarray(mask),
               strength=strength, num_inference_steps=10, true_cfg_scale=1.0,
               generator=torch.Generator("cpu").manual_seed(3), output_type="latent").images
    assert torch.equal(j.latents, ref)
