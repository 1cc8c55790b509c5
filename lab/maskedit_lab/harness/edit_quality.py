"""How close a mask-aware (cached) edit's image is to the full computation's, as the ControlNet mask benchmarks
report it, and the host's load beside each measurement."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image
from skimage.metrics import peak_signal_noise_ratio, structural_similarity


def loadavg() -> float:
    """The 1-minute load average (the benchmarks record it beside their timings)."""
    return round(os.getloadavg()[0], 2)


def rgb(png_bytes: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png_bytes)).convert("RGB"))


def quality(full: np.ndarray, hit: np.ndarray, m: np.ndarray) -> dict:
    """SSIM / PSNR of the whole image, and over the mask's bounding box / pixels (``m``: boolean): the whole image's
    figures also count the template pixels composited outside the mask, equal in both."""
    ys, xs = np.nonzero(m)
    box = (slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1))
    ssim = lambda a, b: round(float(structural_similarity(a, b, channel_axis=2, data_range=255)), 4)  # noqa: E731
    psnr = lambda a, b: round(float(peak_signal_noise_ratio(a, b, data_range=255)), 2)  # noqa: E731
    return {"ssim": ssim(full, hit), "psnr_db": psnr(full, hit),
            "ssim_mask_box": ssim(full[box], hit[box]), "psnr_mask_db": psnr(full[m], hit[m])}
