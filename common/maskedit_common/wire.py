"""How an image arrives on the wire: encoded bytes as they are (gRPC, the binary HTTP protocol), or the same
bytes in base64 (JSON bodies: Triton's generate endpoint, the endpoint picker's view of them). The backend's
pre-processing and the router's mask features both read images through ``maybe_base64``."""

from __future__ import annotations

import base64
import binascii

# Leading bytes of the image formats Pillow decodes here: PNG, JPEG, RIFF (WebP), GIF, BMP, TIFF (both orders).
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF", b"GIF8", b"BM", b"II*\x00", b"MM\x00*")


def maybe_base64(data: bytes) -> tuple[bytes, bool]:
    """Return (raw bytes, was_base64). JSON clients (Triton's generate endpoint) must send images as base64."""
    head = data[:16]
    if any(head.startswith(m) for m in _MAGIC):
        return data, False
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        return data, False
    return raw, True
