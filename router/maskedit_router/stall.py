"""The router noticing that it was itself stopped (SIGSTOP, a frozen VM, a starved host): a loop that should tick
every ``interval_s`` finds far more time since its last tick. Evidence from before such a gap (no answer from a
backend for 30 s, a request that "waited" 30 s in front of a backend's admission check) says nothing about the
backends: they went on working while the router did not look. Each periodic loop that judges backends by elapsed
time keeps its own detector and discounts the gap."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("maskedit.router")


class StallDetector:
    def __init__(self, interval_s: float, threshold_s: float = 2.0, name: str = "router"):
        """A gap of more than ``interval_s + threshold_s`` between two ticks is a stall."""
        self.interval, self.threshold, self.name = interval_s, threshold_s, name
        self.last: float | None = None

    def tick(self, now: float | None = None) -> float:
        """Seconds this process was stalled since the last tick (0 when it was not)."""
        now = time.monotonic() if now is None else now
        gap = 0.0 if self.last is None else now - self.last - self.interval
        self.last = now
        if gap <= self.threshold:
            return 0.0
        log.warning("router resumed after a stall", extra={"fields": {"stalled_s": round(gap, 1), "loop": self.name}})
        return gap
