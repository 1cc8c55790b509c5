"""One rule for which mask pixels are edited, read the same by the backend's pre-processing and the router's
features: gray at or above the threshold, never a transparent pixel (whatever its colour)."""

import io

import numpy as np
import pytest
from PIL import Image

from maskedit.imaging import binary_mask
from maskedit_common.mask_pixels import edited
from maskedit_router.placement.features import mask_ratio, mask_tokens
from tests.conftest import png


def _reference(mask: Image.Image, threshold: int) -> np.ndarray:
    """The rule written out on arrays (the backend's code before it moved to ``mask_pixels``)."""
    if mask.mode in ("RGBA", "LA") or "transparency" in mask.info:
        rgba = mask.convert("RGBA")
        gray = np.asarray(rgba.convert("L"), dtype=np.uint8) * (np.asarray(rgba)[..., 3] > 0)
    else:
        gray = np.asarray(mask.convert("L"), dtype=np.uint8)
    return (gray >= threshold).astype(np.uint8) * 255


def _masks():
    rng = np.random.default_rng(7)
    gray = rng.integers(0, 256, (40, 56), dtype=np.uint8)
    alpha = np.where(rng.random((40, 56)) < 0.3, 0, rng.integers(1, 256, (40, 56))).astype(np.uint8)
    yield Image.fromarray(gray)  # L
    yield Image.fromarray(np.dstack([gray, gray // 2, 255 - gray]))  # RGB
    yield Image.fromarray(np.dstack([gray, gray, gray, alpha]))  # RGBA, some pixels transparent
    yield Image.fromarray(np.dstack([gray, alpha]), "LA")
    yield Image.fromarray(gray >= 100)  # mode "1"
    p = Image.fromarray(gray).convert("P")
    p.info["transparency"] = int(np.asarray(p)[0, 0])  # a palette colour that is transparent
    yield p
    lt = Image.fromarray(gray)
    lt.info["transparency"] = int(gray[3, 4])  # a gray level that is transparent
    yield lt


@pytest.mark.parametrize("threshold", [0, 1, 127, 128, 255, 256])
def test_the_rule_is_the_backends_former_arrays(threshold):
    for mask in _masks():
        got = edited(mask, threshold)
        assert got.dtype == bool and got.shape == (40, 56), mask.mode
        assert (got.astype(np.uint8) * 255 == _reference(mask, threshold)).all(), (mask.mode, threshold)


def test_saved_and_decoded_masks_follow_it_too():
    for mask in _masks():
        back = Image.open(io.BytesIO(png(mask)))
        assert (edited(back).astype(np.uint8) * 255 == _reference(back, 128)).all(), mask.mode


def test_router_and_backend_read_a_white_transparent_region_as_not_edited():
    # RGBA: white everywhere, the left half transparent. Backend and router both edit only the right half; before the
    # shared rule the router's convert("L") counted the whole image.
    rgba = np.full((64, 64, 4), 255, np.uint8)
    rgba[:, :32, 3] = 0
    mask = Image.fromarray(rgba)
    binary = binary_mask(mask, (64, 64), 128)
    assert (binary[:, :32] == 0).all() and (binary[:, 32:] == 255).all()
    ratio, tokens = mask_ratio(png(mask), resolution=64)  # 4 x 4 tokens
    assert (ratio, tokens) == (0.5, 16)
    assert mask_tokens(png(mask), 64).reshape(4, 4)[:, :2].sum() == 0


def test_the_crop_is_around_the_opaque_edit_only():
    rgba = np.zeros((128, 128, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[:16, :16] = (255, 255, 255, 0)  # white but transparent: not edited, so not in the crop
    rgba[96:112, 96:112] = (255, 255, 255, 255)
    grid = mask_tokens(png(Image.fromarray(rgba)), resolution=64, pad=0)
    assert grid.all()  # the crop is the 16 x 16 opaque square alone: every token of its grid is edited
