"""A failed edit (the service's status code, field and message) as an OpenAI error with its HTTP status."""

from __future__ import annotations

import re

from .openai_form import PARAM_OF_TENSOR, ApiError

# Status names the service and the router put in front of a message -> HTTP status and OpenAI error code.
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_value"),
    "RESOURCE_EXHAUSTED": (429, "queue_full"),  # a denoise queue or the router's in-flight limit is full
    "UNAVAILABLE": (503, "service_unavailable"),  # no healthy backend (or one failed after answering)
    "DEADLINE_EXCEEDED": (504, "deadline_exceeded"),
    "CANCELLED": (499, "cancelled"),
    "INTERNAL": (500, "internal_error"),
    "UNAUTHENTICATED": (401, "invalid_api_key"),
    "PERMISSION_DENIED": (403, "insufficient_permissions"),
    "UNKNOWN": (500, "internal_error"),
}
# The chain of status names a message starts with: the Python backend of Triton 2.51 has no RESOURCE_EXHAUSTED or
# DEADLINE_EXCEEDED codes, so those arrive as "UNAVAILABLE: RESOURCE_EXHAUSTED: ..." and the last name is meant.
_CHAIN = re.compile(r"^(?:(?:%s): )+" % "|".join(STATUS))


def from_edit_error(code: str, field: str | None, message: str) -> ApiError:
    """``code``/``field`` as ``maskedit_client.EditError`` reads them from the service's message."""
    text = message.strip()
    chain = _CHAIN.match(text)
    if chain:
        code = chain.group(0).rstrip(": ").split(": ")[-1]
        text = text[chain.end():]
        if field in STATUS:  # the client took the inner status name for a field name
            field = text.split(": ", 1)[0] if text.split(": ", 1)[0] in PARAM_OF_TENSOR else None
    status, oa_code = STATUS.get(code, (500, "internal_error"))
    param = PARAM_OF_TENSOR.get(field or "")
    if field and param:
        text = f"{param}: {text[len(field) + 2:]}" if text.startswith(f"{field}: ") else f"{param}: {text}"
    if field and not param:  # a tensor the form does not set: say which
        text = f"{field}: {text}" if not text.startswith(field) else text
    return ApiError(status, text, param, oa_code)
