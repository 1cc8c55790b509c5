"""REFERENCE_IMAGES through the stages in one process: FLUX.1 Kontext with a reference image equals the stock
pipeline's ``image_reference``; the reference is in the cache key; bad reference images are refused by name."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit.build_model import build
from maskedit.errors import InvalidInput
from maskedit.local import LocalEditor
from maskedit.params import parse_params
from maskedit_common.settings import load_settings
from tests.conftest import png


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    d = tmp_path_factory.mktemp("kontext-refs")
    model = build(d / "model", "kontext-tiny")
    settings = load_settings({"MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_DEVICE": "cpu"})
    ed = LocalEditor(settings)
    yield ed, model
    ed.close()


def _img(seed, w=256, h=256):
    rs = np.random.RandomState(seed)
    return Image.fromarray((np.kron(rs.rand(h // 32, w // 32, 3), np.ones((32, 32, 1))) * 255).astype(np.uint8))


def _mask():
    m = np.zeros((256, 256), np.uint8)
    m[64:160, 80:200] = 255
    return m


def test_a_reference_image_equals_stock_image_reference(kontext):
    from diffusers import FluxKontextInpaintPipeline

    ed, model = kontext
    tpl, ref, mask = _img(1), _img(2), _mask()
    out, p, job = ed.edit(png(tpl), png(mask), "make it red", seed=3, steps=3, guidance=2.5, raw_output=True,
                          template_seed=3, reference_images=[png(ref)])
    assert p.reference.shape == p.latents.shape and p.reference_grids.tolist() == [[16, 16]]
    stock = FluxKontextInpaintPipeline.from_pretrained(model)
    stock.set_progress_bar_config(disable=True)
    kw = dict(prompt="make it red", image=tpl, mask_image=Image.fromarray(mask), height=256, width=256,
              max_area=256 * 256, _auto_resize=False, num_inference_steps=3, strength=1.0, guidance_scale=2.5,
              max_sequence_length=ed.settings.max_sequence_length, generator=torch.Generator("cpu").manual_seed(3))
    latents = stock(image_reference=ref, output_type="latent", **kw).images
    np.testing.assert_array_equal(job.result(), latents[0].numpy())
    kw["generator"] = torch.Generator("cpu").manual_seed(3)
    theirs = stock(image_reference=ref, output_type="pil", **kw).images[0]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(out))), np.asarray(theirs))


def test_the_reference_is_in_the_cache_key(kontext):
    ed, _ = kontext
    tpl, mask = png(_img(1)), png(_mask())
    params = parse_params(ed.settings, "x", steps=2)
    keys = [ed.pre(tpl, mask, params, (), refs).cache_key for refs in ((), [png(_img(2))], [png(_img(3))])]
    assert len(set(keys)) == 3 and all(keys)


@pytest.mark.parametrize("refs, says", [
    ([b"not an image"], "reference 0: could not decode image"),
    ([png(np.zeros((8, 8, 3), np.uint8))], "reference 0: image is 8x8; both sides must be at least 16 pixels"),
    ([png(np.zeros((32, 32, 3), np.uint8))] * 2, "has 2 images, above the limit of 1 for this model"),
])
def test_bad_reference_images_are_refused_by_name(kontext, refs, says):
    ed, _ = kontext
    with pytest.raises(InvalidInput) as e:
        ed.edit(png(_img(1)), png(_mask()), "x", steps=2, reference_images=refs)
    assert e.value.field == "REFERENCE_IMAGES" and says in str(e.value)
    assert ed.edit(png(_img(1)), png(_mask()), "x", steps=1)[2] is not None  # and it keeps serving


def test_families_without_references_refuse_them(settings):
    ed = LocalEditor(settings)  # the tiny Flux Fill model
    try:
        with pytest.raises(InvalidInput) as e:
            ed.edit(png(_img(1)), png(_mask()), "x", steps=1, reference_images=[png(_img(2))])
        assert e.value.field == "REFERENCE_IMAGES" and "take no reference image" in str(e.value)
    finally:
        ed.close()
