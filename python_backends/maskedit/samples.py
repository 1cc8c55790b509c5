"""Synthetic templates and masks: the demo's and the docs' example inputs and the load generator's mask shapes.

Masks come in the three shapes real edit traffic has (InstGenIE's workloads): boxes (object replacement),
blobs (retouching), person-shaped regions (virtual try-on), each scaled to a requested area ratio.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def template(width: int = 384, height: int = 288, seed: int = 0) -> Image.Image:
    """A small procedural scene (sky, sun, hills, a figure) so edits are easy to see."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None, None]
    sky = (np.array([70, 130, 200]) * (1 - y) + np.array([200, 220, 240]) * y) * np.ones((1, width, 1))
    img = Image.fromarray(sky.astype(np.uint8))
    d = ImageDraw.Draw(img)
    d.ellipse([width * 0.72, height * 0.08, width * 0.86, height * 0.27], fill=(250, 220, 90))
    for k, color in enumerate([(60, 120, 60), (40, 95, 45)]):
        pts = [(x, height * (0.62 + 0.1 * k) + 18 * math.sin(x / (37 + 11 * k) + k)) for x in range(0, width + 8, 8)]
        d.polygon(pts + [(width, height), (0, height)], fill=color)
    cx, cy = width * 0.35, height * 0.55
    d.ellipse([cx - 14, cy - 70, cx + 14, cy - 42], fill=(230, 190, 160))
    d.rectangle([cx - 22, cy - 42, cx + 22, cy + 20], fill=(180, 40, 50))
    d.rectangle([cx - 18, cy + 20, cx + 18, cy + 62], fill=(40, 50, 90))
    noise = rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(img, np.float32) + noise, 0, 255).astype(np.uint8))


def box_mask(width: int, height: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    aspect = rng.uniform(0.6, 1.6)
    area = ratio * width * height
    w = min(width, int(round(math.sqrt(area * aspect))))
    h = min(height, int(round(area / max(w, 1))))
    w = min(width, int(round(area / max(h, 1))))  # if the height was clamped, widen to keep the area
    x0 = int(rng.integers(0, width - w + 1))
    y0 = int(rng.integers(0, height - h + 1))
    m = np.zeros((height, width), np.uint8)
    m[y0:y0 + h, x0:x0 + w] = 255
    return m


def blob_mask(width: int, height: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Smoothed random field thresholded at the quantile that gives ``ratio`` of the pixels."""
    coarse = rng.random((4, 4))
    field = np.asarray(Image.fromarray((coarse * 255).astype(np.uint8)).resize((width, height), Image.BICUBIC)
                       .filter(ImageFilter.GaussianBlur(4)), np.float32)
    cy, cx = rng.uniform(0.3, 0.7) * height, rng.uniform(0.3, 0.7) * width
    yy, xx = np.mgrid[0:height, 0:width]
    field = field - 3.0 * np.hypot((yy - cy) / height, (xx - cx) / width) * 255  # one main region, not confetti
    return _quantile(field, ratio)


def person_mask(width: int, height: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Head + torso + legs silhouette (a try-on region), scaled to the requested area."""
    sil = Image.new("L", (100, 200), 0)
    d = ImageDraw.Draw(sil)
    d.ellipse([35, 0, 65, 34], fill=255)
    d.rounded_rectangle([18, 34, 82, 118], radius=14, fill=255)
    d.rectangle([24, 118, 48, 200], fill=255)
    d.rectangle([52, 118, 76, 200], fill=255)
    base = float((np.asarray(sil) > 0).mean()) * 100 * 200
    scale = math.sqrt(ratio * width * height / base)
    sw, sh = max(1, int(100 * scale)), max(1, int(200 * scale))
    if sh > height:  # too tall for the frame: full height, wider figure of the same area
        sw, sh = int(100 * scale * sh / height), height
    if sw > width:
        return box_mask(width, height, ratio, rng)
    sil = sil.resize((sw, sh), Image.NEAREST)
    m = Image.new("L", (width, height), 0)
    m.paste(sil, (int(rng.integers(0, width - sw + 1)), int(rng.integers(0, height - sh + 1))))
    return np.asarray(m, np.uint8)


def _quantile(field: np.ndarray, ratio: float) -> np.ndarray:
    if ratio <= 0:
        return np.zeros(field.shape, np.uint8)
    thr = np.quantile(field, 1 - min(ratio, 1.0))
    return ((field >= thr) * 255).astype(np.uint8)


SHAPES = {"box": box_mask, "blob": blob_mask, "person": person_mask}


def mask(width: int, height: int, ratio: float, shape: str = "blob", seed: int = 0) -> np.ndarray:
    return SHAPES[shape](width, height, ratio, np.random.default_rng(seed))


# The example inputs of README and docs/: (name, mask shape, area ratio); `make demo` edits each.
EXAMPLE_MASKS = [("small_box", "box", 0.05), ("medium_blob", "blob", 0.2), ("large_person", "person", 0.4)]


def write_examples(out: str | Path, seed: int = 7) -> Image.Image:
    """Write the examples' inputs to ``out`` (``make demo`` and ``make serve`` write them to out/): template.png,
    mask_<name>.png (white = edit) and edges.png (the template's canny edge map, a ControlNet control image, as the
    server's ``canny`` preprocessor makes it). Returns the template."""
    from .controlnets.preprocessors import canny

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tpl = template()
    tpl.save(out / "template.png")
    for name, shape, ratio in EXAMPLE_MASKS:
        Image.fromarray(mask(*tpl.size, ratio, shape, seed=seed)).save(out / f"mask_{name}.png")
    canny(tpl).save(out / "edges.png")
    return tpl


if __name__ == "__main__":
    import sys

    write_examples(sys.argv[1] if len(sys.argv) > 1 else "out")
