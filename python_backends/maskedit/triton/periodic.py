"""Metrics kept up to date between requests: a daemon thread calling ``fn`` every ``interval_s`` until the returned
event is set; a failure is logged and the loop goes on (metrics must never take a model down)."""

from __future__ import annotations

import logging
import threading


def every(fn, interval_s: float, name: str) -> threading.Event:
    stop = threading.Event()

    def loop():
        while not stop.wait(interval_s):
            try:
                fn()
            except Exception:
                logging.getLogger(__name__).exception("%s failed", name)

    threading.Thread(target=loop, daemon=True, name=name).start()
    return stop
