"""Image and mask handling at the edges of the pipeline: decode and validate, size, composite, encode.

Decoding is done by Pillow. Everything here is plain numpy/PIL so it unit-tests without a model.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
from PIL import Image, ImageFilter

from maskedit_common import mask_pixels  # shared with the router
from maskedit_common.wire import maybe_base64  # shared with the router

from .errors import InvalidInput

__all__ = ["ASPECT_TOLERANCE", "binary_mask", "composite", "decode_image", "encode_image", "encode_png", "maybe_base64",
           "model_size", "soft_mask", "token_mask"]

# Aspect ratios closer than this are "the same" when a mask is resized onto its template.
ASPECT_TOLERANCE = 0.01


def decode_image(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """Decode an encoded image, checking its size from the header before decoding the pixels."""
    if not data:
        raise InvalidInput("is empty; expected an encoded PNG, JPEG or WebP image", field)
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > max_pixels:
            raise InvalidInput(f"image is {w}x{h} = {w * h} pixels, above the limit of {max_pixels}", field)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()  # forces the full decode: truncated files fail here, not later
    except InvalidInput:
        raise
    except Image.DecompressionBombError:  # a header claiming > 2x Pillow's own limit: refused on opening
        raise InvalidInput(f"image is above the limit of {max_pixels} pixels", field) from None
    except Image.UnidentifiedImageError:  # its message is a repr of our buffer: say what it means instead
        raise InvalidInput("could not decode image (not a PNG, JPEG, WebP or other format Pillow reads)",
                           field) from None
    except Exception as e:  # Pillow raises many types for bad data
        raise InvalidInput(f"could not decode image ({type(e).__name__}: {e})", field) from None
    if w < 16 or h < 16:
        raise InvalidInput(f"image is {w}x{h}; both sides must be at least 16 pixels", field)
    return img


def binary_mask(mask: Image.Image, size: tuple[int, int], threshold: int) -> np.ndarray:
    """Grayscale-threshold ``mask`` (white = edit, a transparent pixel never: ``maskedit_common.mask_pixels``) and
    bring it to ``size`` (w, h) of the template.

    A mask of another size is resized (nearest) when its aspect ratio matches the template's; a mask of
    a different shape is an error because stretching it would move the edit.
    """
    binary = mask_pixels.edited(mask, threshold).astype(np.uint8) * 255  # the router reads masks by this rule too
    if mask.size != size:
        mw, mh = mask.size
        tw, th = size
        if abs(mw / mh - tw / th) > ASPECT_TOLERANCE * (tw / th):
            raise InvalidInput(
                f"mask is {mw}x{mh} but the template is {tw}x{th}; a mask must match the template's size or "
                "at least its aspect ratio",
                "MASK",
            )
        binary = np.asarray(Image.fromarray(binary).resize(size, Image.NEAREST))
    return binary


def model_size(width: int, height: int, resolution: int, multiple: int = 16) -> tuple[int, int]:
    """(w, h) the model runs at: about ``resolution**2`` pixels, the template's aspect kept, sides multiples of 16."""
    scale = math.sqrt(resolution * resolution / (width * height))
    w = max(multiple, int(round(width * scale / multiple)) * multiple)
    h = max(multiple, int(round(height * scale / multiple)) * multiple)
    return w, h


def token_mask(mask_model: np.ndarray, patch: int) -> np.ndarray:
    """Which image tokens the edit touches: a token is masked if any pixel of its ``patch``x``patch`` block is.

    ``mask_model`` is the binary mask at model resolution (h, w) with values in {0, 1}; the result is a flat
    bool array in Flux's packed token order (row-major over the token grid).
    """
    h, w = mask_model.shape
    blocks = mask_model.reshape(h // patch, patch, w // patch, patch)
    return blocks.max(axis=(1, 3)).reshape(-1) > 0


def soft_mask(binary: np.ndarray, feather_px: int) -> np.ndarray:
    """Alpha (uint8) for compositing: the mask grown by ``feather_px`` then blurred, so the edit fully shows
    inside the mask and fades into the template over a few pixels outside it."""
    if feather_px <= 0:
        return binary.copy()
    img = Image.fromarray(binary).filter(ImageFilter.MaxFilter(2 * feather_px + 1))
    soft = np.asarray(img.filter(ImageFilter.GaussianBlur(feather_px / 2)), dtype=np.uint8)
    return np.maximum(soft, binary)  # the blur must not fade the edit inside the mask itself


def composite(template: np.ndarray, generated: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Keep the template outside the mask: template*(1-a) + generated*a, all uint8 HxW(x3)."""
    a = alpha.astype(np.float32)[..., None] / 255.0
    out = template.astype(np.float32) * (1.0 - a) + generated.astype(np.float32) * a
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def encode_png(rgb: np.ndarray | Image.Image) -> bytes:
    return encode_image(rgb)


def encode_image(rgb: np.ndarray | Image.Image, fmt: str = "png", quality: int = 95) -> bytes:
    """The response image in OUTPUT_FORMAT (png, jpeg, webp; Pillow's encoders) at OUTPUT_QUALITY (jpeg, webp)."""
    img = rgb if isinstance(rgb, Image.Image) else Image.fromarray(rgb)
    buf = io.BytesIO()
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=1)  # fast: PNG encoding is on the response path
    elif fmt == "jpeg":
        img.save(buf, format="JPEG", quality=int(quality))
    elif fmt == "webp":
        img.save(buf, format="WEBP", quality=int(quality))
    else:
        raise InvalidInput(f"must be png, jpeg or webp, got {fmt!r:.40}", "OUTPUT_FORMAT")
    return buf.getvalue()
