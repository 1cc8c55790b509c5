"""The router costs the stock pipelines' parameters as the backend runs them: a STRENGTH s edit ~s x steps, a
PADDING_MASK_CROP edit at its crop's tokens (the backend edits the crop at the model's size, keyed on the crop)."""

import numpy as np
import pytest
from tritonclient.grpc._utils import _get_inference_request

from maskedit_client.inputs import edit_inputs
from maskedit_common.cost_model import CostModel
from maskedit_router.placement.features import crop_box, extract
from maskedit_router.placement.policies import Estimator
from tests.conftest import png

EST = Estimator(CostModel.fallback())


def request(mask, **kw):
    tpl = np.full((512, 512, 3), 128, np.uint8)
    inputs = edit_inputs(png(tpl), png(mask), "a hat", steps=20, **kw)
    return _get_inference_request("edit", inputs, "", "r", None, 0, False, False, 0, None, None)


@pytest.fixture()
def mask():
    m = np.zeros((512, 512), np.uint8)
    m[200:260, 180:300] = 255  # ~3 % of the image
    return m


def test_strength_costs_its_share_of_the_steps(mask):
    whole, part = extract(request(mask), 512), extract(request(mask, strength=0.25), 512)
    assert (whole.strength, part.strength, whole.run_steps, part.run_steps) == (1.0, 0.25, 20, 5)
    for cached in (False, True):
        assert EST.request_ms(part, cached) == pytest.approx(EST.request_ms(whole, cached) / 4)
    assert part.template_key == whole.template_key  # one entry serves every strength


def test_a_cropped_edit_is_costed_at_its_crop(mask):
    whole, cropped = extract(request(mask), 512), extract(request(mask, padding_mask_crop=16), 512)
    assert cropped.tokens == whole.tokens  # the crop runs at the model's size: its grid
    assert cropped.mask_ratio > 5 * whole.mask_ratio  # the mask fills most of it
    assert EST.request_ms(cropped, True) > EST.request_ms(whole, True)  # less for the cache to serve
    assert cropped.template_key != whole.template_key  # its entry is keyed on the crop


def test_crop_box_is_the_stock_crop_region():
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    m = np.zeros((200, 400), bool)
    m[50:60, 100:120] = True
    for pad in (0, 10, 75, 10_000):
        stock = VaeImageProcessor.get_crop_region(Image.fromarray(m.astype(np.uint8) * 255), 400, 200, pad)
        assert crop_box(m, pad) == tuple(stock)
    assert crop_box(np.zeros((8, 8), bool), 4) is None
