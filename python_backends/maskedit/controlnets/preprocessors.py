"""Server-side control-image preprocessors, for clients that send a photo rather than a control map: ``canny``
(OpenCV's Canny edge detector at the thresholds Diffusers' ControlNet examples use, 100 / 200, as a 3-channel
white-on-black map)."""

from __future__ import annotations

import numpy as np
from PIL import Image

CANNY_THRESHOLDS = (100, 200)


def canny(image: Image.Image) -> Image.Image:
    import cv2  # opencv-python-headless (requirements.txt); only processes that preprocess import it

    edges = cv2.Canny(np.asarray(image.convert("RGB")), *CANNY_THRESHOLDS)
    return Image.fromarray(np.stack([edges] * 3, axis=-1))


PREPROCESSORS = {"canny": canny}


def apply(name: str | None, image: Image.Image) -> Image.Image:
    return image if name is None else PREPROCESSORS[name](image)
