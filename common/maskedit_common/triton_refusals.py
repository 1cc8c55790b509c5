"""Triton's own refusals of a request no model has started: a queue policy in front of a model answers "Exceeds
maximum queue size" at once when its queue is full, and "Request timeout expired" for a request that waited its
timeout there, both with Triton's UNAVAILABLE code (2.51 has no RESOURCE_EXHAUSTED for them) and no status name in
the text. Our repository no longer carries a policy (``maskedit.intake`` holds that bound, and its refusal starts
with RESOURCE_EXHAUSTED): these come from servers of an older repository, or a config that adds one. They are refusals, like the denoise queue's: an
answer that the service is full, not a broken backend. ``as_refusal`` puts the status name in front, so the router
(its admission, its breaker, its health probe) and every client read them as RESOURCE_EXHAUSTED."""

from __future__ import annotations

import re

_TRITON_QUEUE = re.compile(r"Exceeds maximum queue size|Request timeout expired")
PREFIX = "RESOURCE_EXHAUSTED: "


def is_queue_refusal(message: str | None) -> bool:
    return bool(message) and bool(_TRITON_QUEUE.search(message)) and "RESOURCE_EXHAUSTED" not in message


def as_refusal(message: str) -> str:
    """``message`` with ``RESOURCE_EXHAUSTED: `` and what it means in front when it is Triton's queue refusal;
    anything else unchanged."""
    if not is_queue_refusal(message):
        return message
    return f"{PREFIX}the server's pre-processing queue is full or waited too long (refused before any work; "\
           f"send again later or to another server): {message}"
