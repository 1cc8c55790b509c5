"""The stages run in one process reproduce stock diffusers.FluxFillPipeline: exactly for float32 on the CPU, within
the stated tolerance in reduced precision or on a GPU (stock then runs in the same dtype on the same device)."""

import io

import numpy as np
import pytest
import torch
from diffusers import FluxFillPipeline
from PIL import Image

from maskedit.components import torch_dtype
from maskedit.local import LocalEditor
from tests.conftest import atol, exact_here, png


@pytest.fixture(scope="module")
def editor(settings):
    ed = LocalEditor(settings)
    yield ed
    ed.close()


@pytest.fixture(scope="module")
def stock(settings):
    pipe = FluxFillPipeline.from_pretrained(settings.model_dir, dtype=torch_dtype(settings))
    return pipe.to(settings.torch_device)


def reference(stock, settings, img, mask, prompt, seed, steps, guidance, output_type):
    w, h = img.size
    return stock(prompt=prompt, image=img, mask_image=Image.fromarray(mask), height=h, width=w,
                 num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=settings.max_sequence_length,
                 generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type).images


def test_latents_and_png_equal_stock_pipeline(editor, stock, settings, template_img, box_mask):
    out, prepared, job = editor.edit(png(template_img), png(box_mask), "a red hat", seed=5, steps=4,
                                     guidance=12.0, raw_output=True, template_seed=5)
    ref_latents = reference(stock, settings, template_img, box_mask, "a red hat", 5, 4, 12.0, "latent")
    np.testing.assert_allclose(job.result(), ref_latents[0].float().cpu().numpy(), atol=atol(settings, 1e-5), rtol=0)
    ref_img = reference(stock, settings, template_img, box_mask, "a red hat", 5, 4, 12.0, "pil")[0]
    ours, theirs = np.asarray(Image.open(io.BytesIO(out)), np.int16), np.asarray(ref_img, np.int16)
    if exact_here(settings):
        assert np.array_equal(ours, theirs)
    else:  # 8-bit pixels of images decoded from latents within the tolerance above
        assert np.abs(ours - theirs).mean() <= 1.0 and np.abs(ours - theirs).max() <= 16


def test_seed_changes_result_and_same_seed_repeats(editor, template_img, box_mask):
    a = editor.edit(png(template_img), png(box_mask), "a red hat", seed=1, steps=2)[0]
    b = editor.edit(png(template_img), png(box_mask), "a red hat", seed=1, steps=2)[0]
    c = editor.edit(png(template_img), png(box_mask), "a red hat", seed=2, steps=2)[0]
    assert a == b and a != c


def test_empty_mask_returns_template_without_running(editor, template_img):
    out, prepared, job = editor.edit(png(template_img), png(np.zeros((256, 256), np.uint8)), "x")
    assert job is None and prepared.empty_mask
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(out))), np.asarray(template_img))


def test_seed_varies_only_the_masked_noise(settings, template_img, box_mask):
    """SEED draws the masked tokens' noise; TEMPLATE_SEED the rest (and the VAE sampling)."""
    from maskedit.params import parse_params
    from maskedit.preprocess import Preprocessor

    pre = Preprocessor(settings)
    a = pre(png(template_img), png(box_mask), parse_params(settings, "x", seed=1, template_seed=0))
    b = pre(png(template_img), png(box_mask), parse_params(settings, "x", seed=2, template_seed=0))
    c = pre(png(template_img), png(box_mask), parse_params(settings, "x", seed=2, template_seed=2))
    m = a.token_mask
    assert np.array_equal(a.latents[~m], b.latents[~m]) and not np.array_equal(a.latents[m], b.latents[m])
    assert not np.array_equal(b.latents[~m], c.latents[~m])  # SEED == TEMPLATE_SEED: stock Diffusers' draw
    assert np.array_equal(a.cond, b.cond) and a.cache_key == b.cache_key != c.cache_key
