"""Calling something that must not block (a FIFO opened by name hangs ``open()``): its outcome, or a failure
instead of a hung test."""

import threading


def in_time(fn, timeout_s: float = 10.0) -> dict:
    """``fn()``'s outcome as ``{"value": ...}`` or ``{"error": ...}``; fails if it has not returned in ``timeout_s``
    (the thread is a daemon: a blocked one does not keep the test run alive)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the caller inspects it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"blocked for {timeout_s} s"
    return out
