"""A request input holding JSON (``LORAS``, ``CONTROLS``): bytes or text decoded the same way for both, with the
same errors; each parser checks the decoded value's shape itself."""

from __future__ import annotations

import json

EXAMPLE = '[{"name": "...", "scale": 0.8}]'  # what the errors show the caller


def decode(value, error: type[ValueError]):
    """``value`` (bytes, JSON text, or an already decoded value) decoded; None when absent or blank. Undecodable
    bytes or invalid JSON raise ``error`` (the input's own error type, which names the field)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise error("is not valid UTF-8 text") from None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise error(f"is not valid JSON ({e.msg} at character {e.pos}); expected {EXAMPLE}") from None
    return value
