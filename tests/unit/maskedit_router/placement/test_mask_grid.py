"""The mask's token grid read by whole-cell reduction where the cells are whole squares of up to ANY_CELL_MAX pixels
is the BOX resize's grid, bit for bit (routing decisions do not change), and is "any edited pixel marks its token"."""

import numpy as np
import pytest
from PIL import Image

from maskedit_router.placement import features
from maskedit_router.placement.features import ANY_CELL_MAX, mask_tokens
from tests.conftest import png


def _box_grid(mask: np.ndarray, resolution: int, pad=None) -> np.ndarray:
    """The grid as the router read it before: threshold, crop, BOX resize of the 0/255 image."""
    binary = mask >= 128
    box = features.crop_box(binary, pad) if pad is not None else None
    if box is not None:
        x1, y1, x2, y2 = box
        binary = binary[y1:y2, x1:x2]
    h, w = binary.shape
    scale = (resolution * resolution / (w * h)) ** 0.5
    gw, gh = max(1, round(w * scale / 16)), max(1, round(h * scale / 16))
    return np.asarray(Image.fromarray(binary.astype(np.uint8) * 255).resize((gw, gh), Image.BOX)).reshape(-1) > 0


def _masks(h: int, w: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    for i in range(n):
        m = np.zeros((h, w), np.uint8)
        for _ in range(1 + i % 6):  # lone pixels: a cell with one edited pixel is the edge case
            m[rng.integers(h), rng.integers(w)] = rng.integers(128, 256)
        if i % 2:  # and a blob of grey levels around the threshold
            y, x = rng.integers(h - 40), rng.integers(w - 40)
            m[y:y + 37, x:x + 23] = rng.integers(100, 160, (37, 23))
        yield m


@pytest.mark.parametrize("h,w,resolution,pad", [
    (512, 512, 512, None),  # 16-pixel cells: the fast path
    (256, 256, 512, None),  # 8-pixel cells
    (480, 640, 512, None),  # not square: 17.3-pixel cells, the resize
    (352, 352, 1024, None),  # 5.5-pixel cells: the resize
    (1024, 1024, 512, None),  # 32-pixel cells: over ANY_CELL_MAX, the resize
    (512, 512, 512, 32),  # a crop
])
def test_the_grid_is_the_box_resize_grid(h, w, resolution, pad):
    for m in _masks(h, w, 24, seed=h + w + resolution):
        got = mask_tokens(png(m), resolution, pad)
        assert got.tolist() == _box_grid(m, resolution, pad).tolist()


def test_whole_cells_mark_a_token_for_one_edited_pixel():
    for k in range(1, ANY_CELL_MAX + 1):
        m = np.zeros((4 * k, 4 * k), np.uint8)
        m[k + k - 1, 2 * k] = 128  # one pixel at the threshold, in cell (1, 2)
        grid = mask_tokens(png(m), resolution=4 * 16)  # 4 x 4 tokens of k pixels each
        assert grid.nonzero()[0].tolist() == [1 * 4 + 2], k


def test_the_fast_path_runs_for_whole_cells(monkeypatch):
    """(negative control: the equivalence above means nothing if the reduction never runs)"""
    called = []
    real = Image.Image.reduce
    monkeypatch.setattr(Image.Image, "reduce", lambda self, k, *a: called.append(k) or real(self, k, *a))
    mask_tokens(png(np.zeros((512, 512), np.uint8)), 512)
    mask_tokens(png(np.zeros((1024, 1024), np.uint8)), 512)
    assert called == [16]


def _extract(template: bytes, mask: bytes, **kw):
    from tritonclient.grpc._utils import _get_inference_request

    from maskedit_client.inputs import edit_inputs

    inputs = edit_inputs(template, mask, "a hat", steps=8, seed=1, **kw)
    return features.extract(_get_inference_request("edit", inputs, "", "r", None, 0, False, False, 0, None, None), 512)


def test_a_mask_sent_again_is_not_decoded_again(monkeypatch):
    """The router remembers a mask's ratio by its bytes (the grid's settings with it): a template's edits that send its
    mask again cost a hash, not a decode; another mask, resolution or crop is measured afresh."""
    ratios = features.MaskRatios(size=2)
    monkeypatch.setattr(features, "MASK_RATIOS", ratios)
    decoded = []
    real = features.mask_ratio
    monkeypatch.setattr(features, "mask_ratio", lambda *a: decoded.append(a[1:3]) or real(*a))
    a, b = np.zeros((64, 64), np.uint8), np.zeros((64, 64), np.uint8)
    a[:16, :16], b[:32] = 255, 255
    template = png(np.full((64, 64, 3), 90, np.uint8))
    first = _extract(template, png(a))
    assert _extract(template + b"another", png(a)).mask_ratio == first.mask_ratio == 0.0625
    assert len(decoded) == 1 and ratios.hits == 1
    assert _extract(template, png(b)).mask_ratio == 0.5 and len(decoded) == 2
    assert ratios(png(a), 1024, None) == real(png(a), 1024, None) and decoded[-1] == (1024, None)  # its own grid
    n = len(decoded)
    ratios(png(b), 512, None)  # seen: now the most recently used of the two kept
    assert len(decoded) == n
    assert ratios(png(a), 512, 4) == real(png(a), 512, 4) and decoded[-1] == (512, 4)
    assert len(ratios._got) == 2  # the least recently used went: a at 1024, not b, which was just read
    ratios(png(b), 512, None)
    assert len(decoded) == n + 1


def test_an_unreadable_mask_is_priced_whole_and_not_remembered():
    ratios = features.MaskRatios()
    with pytest.raises(Exception):
        ratios(b"not a png", 512, None)
    assert not ratios._got and ratios.misses == 1
    f = _extract(png(np.full((64, 64, 3), 90, np.uint8)), b"not a png")
    assert f.mask_ratio == 1.0 and f.tokens == features.grid_tokens(512)


def test_masks_are_read_at_the_backends_threshold(monkeypatch):
    """A deployment that moves MASKEDIT_MASK_THRESHOLD moves it for the router too (``build`` reads the same
    settings): a mask of gray 100 is no edit at the default 128 and a whole edit at 64, and a ratio remembered at
    one threshold is not reused at another."""
    from maskedit_router.__main__ import build

    m = png(np.full((64, 64), 100, np.uint8))
    ratios = features.MaskRatios()
    monkeypatch.setattr(features, "MASK_RATIOS", ratios)
    assert ratios(m, 512, None)[0] == 0.0
    ratios.threshold = 64
    assert ratios(m, 512, None)[0] == 1.0 and ratios.misses == 2
    monkeypatch.setenv("MASKEDIT_MASK_THRESHOLD", "90")
    monkeypatch.setattr("maskedit_router.__main__.MASK_RATIOS", ratios)
    build(["10.0.0.1:8001"], resolution=512)
    assert ratios.threshold == 90 and _extract(png(np.full((64, 64, 3), 90, np.uint8)), m).mask_ratio == 1.0
    build(["10.0.0.1:8001"], resolution=512, mask_threshold=200)
    assert ratios.threshold == 200 and ratios(m, 512, None)[0] == 0.0
