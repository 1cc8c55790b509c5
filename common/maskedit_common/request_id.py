"""The request id in an error's text: ``message [request id: ID]``.

tritonclient's stream callback hands a client only an error's text (the response's id field is dropped), so a client
with several requests pending on one stream matches an error to its request by this. The backend writes it, the
router reads it from a backend's errors and writes its own client's id in its place. The client ships without server
code and mirrors ``PATTERN`` (``maskedit_client.client``); a test holds the two equal.
"""

from __future__ import annotations

import re

PATTERN = re.compile(r"request id: ([\w-]+)")


def tagged(message: str, request_id: str | None) -> str:
    """``message`` naming ``request_id`` (as it is when it names it already, or there is no id)."""
    if not request_id or f"request id: {request_id}" in message:
        return message
    return f"{message} [request id: {request_id}]"


def named(text: str) -> str | None:
    """The request id an error's text names, if any."""
    m = PATTERN.search(text)
    return m.group(1) if m else None
