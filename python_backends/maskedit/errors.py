"""Errors a request can end with; each names the field at fault so clients can fix the call."""

from __future__ import annotations


class EditError(Exception):
    """Base class: ``code`` maps onto a Triton/gRPC status code name."""

    code = "INTERNAL"

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class InvalidInput(EditError):
    code = "INVALID_ARGUMENT"


class ResourceExhausted(EditError):
    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(EditError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(EditError):
    code = "CANCELLED"


class Unavailable(EditError):
    code = "UNAVAILABLE"
