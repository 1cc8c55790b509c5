import numpy as np
import pytest
from PIL import Image

from maskedit import imaging
from maskedit.errors import InvalidInput
from tests.conftest import png


def test_decode_rejects_garbage_and_truncated(template_img):
    with pytest.raises(InvalidInput, match="TEMPLATE: could not decode"):
        imaging.decode_image(b"not an image at all", "TEMPLATE", 10**8)
    data = png(template_img)
    with pytest.raises(InvalidInput, match="TEMPLATE"):
        imaging.decode_image(data[: len(data) // 2], "TEMPLATE", 10**8)


def test_decode_pixel_limit_checked_from_header():
    big = png(np.zeros((300, 400, 3), np.uint8))
    with pytest.raises(InvalidInput, match=r"MASK: image is 400x300 = 120000 pixels, above the limit of 100000"):
        imaging.decode_image(big, "MASK", 100_000)


def test_binary_mask_thresholds_at_128():
    gray = np.array([[0, 127, 128, 255]], np.uint8).repeat(4, 0)
    out = imaging.binary_mask(Image.fromarray(gray), (4, 4), threshold=128)
    assert out[0].tolist() == [0, 0, 255, 255]


def test_mask_resized_when_aspect_matches_error_otherwise():
    m = np.zeros((50, 100), np.uint8)
    m[:, 50:] = 255
    out = imaging.binary_mask(Image.fromarray(m), (200, 100), 128)
    assert out.shape == (100, 200) and out[:, 100:].all() and not out[:, :100].any()
    with pytest.raises(InvalidInput, match="MASK: mask is 100x50 but the template is 100x100"):
        imaging.binary_mask(Image.fromarray(m), (100, 100), 128)


def test_transparent_mask_pixels_are_not_edited():
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., :3] = 255
    rgba[:4, :, 3] = 255  # only the top half is opaque
    out = imaging.binary_mask(Image.fromarray(rgba), (8, 8), 128)
    assert out[:4].all() and not out[4:].any()


@pytest.mark.parametrize("w,h", [(256, 256), (640, 480), (300, 1000), (17, 17)])
def test_model_size_keeps_aspect_and_multiples(w, h):
    mw, mh = imaging.model_size(w, h, 256, 16)
    assert mw % 16 == 0 and mh % 16 == 0
    assert abs(mw * mh - 256 * 256) / (256 * 256) < 0.15 or min(mw, mh) == 16
    assert abs(mw / mh - w / h) / (w / h) < 0.1


def test_token_mask_marks_any_touched_patch():
    m = np.zeros((32, 48), np.uint8)
    m[0, 0] = 1  # one pixel in token 0
    m[20, 40] = 1  # token (1, 2)
    tokens = imaging.token_mask(m, 16)
    assert tokens.shape == (6,) and tokens.tolist() == [True, False, False, False, False, True]


def test_composite_keeps_template_outside_feathered_mask():
    tpl = np.full((40, 40, 3), 10, np.uint8)
    gen = np.full((40, 40, 3), 200, np.uint8)
    binary = np.zeros((40, 40), np.uint8)
    binary[10:30, 10:30] = 255
    alpha = imaging.soft_mask(binary, 3)
    out = imaging.composite(tpl, gen, alpha)
    assert (out[10:30, 10:30] == 200).all()  # inside: fully the generated pixels
    assert (out[:2] == 10).all() and (out[:, 38:] == 10).all()  # beyond the feather: template untouched
    assert 10 < out[8, 20, 0] < 200  # the feathered edge blends
