"""What an edit ends in: an ``EditResult`` (the PNG and the server's EDIT_INFO) or an ``EditError`` whose status
code and input field are read from the server's message (ours, or Triton's own refusal of a malformed request)."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field

from PIL import Image

# the status names our models and the router put at the front of an error message
CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE", "INTERNAL",
         "UNAUTHENTICATED", "PERMISSION_DENIED")
_CODE = re.compile(r"\b(%s): " % "|".join(CODES))
_FIELD = re.compile(r"^([A-Z_]+): ")
_TRITON_INVALID = re.compile(r"data-type is|expects|unexpected shape|missing required input|unexpected inference input"
                             r"|expected number of inputs|shape")
_TRITON_FIELD = re.compile(r"(?:input '|input\(s\) \[')([A-Za-z0-9_]+)'")
_RETRY_AFTER = re.compile(r"retry after ([0-9.]+) s")
# Triton's own refusals in front of a model with a queue policy (full, or waited too long; servers of an older
# repository: ours now refuses at its intake, with the status name), which carry no status name: the server is full,
# as a RESOURCE_EXHAUSTED refusal says (maskedit_common.triton_refusals)
_TRITON_QUEUE = re.compile(r"Exceeds maximum queue size|Request timeout expired")


class EditError(Exception):
    """A failed edit. ``code`` is the status name (INVALID_ARGUMENT, ...), ``field`` the input at fault."""

    def __init__(self, message: str, code: str = "UNKNOWN", field: str | None = None):
        super().__init__(message)
        self.code, self.field = code, field
        m = _RETRY_AFTER.search(message)
        # a refusal's hint (the router's per-tenant limits): when to send again
        self.retry_after_s = float(m.group(1)) if m else None

    @classmethod
    def from_server(cls, message: str) -> "EditError":
        m = _CODE.search(message)
        if not m:
            if _TRITON_QUEUE.search(message):
                return cls(f"RESOURCE_EXHAUSTED: the server's queue is full (refused before any work): {message}",
                           "RESOURCE_EXHAUSTED")
            # Triton itself rejected the request before our models saw it: missing tensor, wrong dtype or shape.
            if _TRITON_INVALID.search(message):
                f = _TRITON_FIELD.search(message)
                return cls(message, "INVALID_ARGUMENT", f.group(1) if f else None)
            return cls(message, "UNKNOWN")
        rest = message[m.end():]
        f = _FIELD.match(rest)
        return cls(message[m.start():], m.group(1), f.group(1) if f else None)


@dataclass
class EditResult:
    png: bytes
    info: dict
    latency_s: float = 0.0
    progress: list = field(default_factory=list)

    @property
    def image(self) -> Image.Image:
        return Image.open(io.BytesIO(self.png))
