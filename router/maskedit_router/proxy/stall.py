"""The router noticing that it was itself stopped (SIGSTOP, a frozen VM, a starved host): a loop that should tick
every ``interval_s`` finds far more time since its last tick. Evidence from before such a gap (no answer from a
backend for 30 s, a request that "waited" 30 s in front of a backend's admission check) says nothing about the
backends: they went on working while the router did not look. Each periodic loop that judges backends by elapsed
time keeps its own detector and discounts the gap (``StallAwareLoop``: the health checker's and the admission
watcher's loops)."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("maskedit.router")


class StallDetector:
    def __init__(self, interval_s: float, threshold_s: float = 3.0, name: str = "router"):
        """A wait of ``interval_s`` that took more than ``interval_s + threshold_s`` is a stall. Only the wait is
        timed, not the loop's own work (a health check's probe may take seconds; that is no stall)."""
        self.interval, self.threshold, self.name = interval_s, threshold_s, name

    def wait(self, stop) -> tuple[bool, float]:
        """``stop.wait(interval_s)``: (whether ``stop`` is set, seconds this process was stalled meanwhile)."""
        t0 = time.monotonic()
        stopped = stop.wait(self.interval)
        return stopped, self.waited(time.monotonic() - t0)

    def waited(self, elapsed_s: float, bound_s: float | None = None) -> float:
        """Seconds of stall in something that takes at most ``bound_s`` (default: the wait, ``interval_s``) and took
        ``elapsed_s`` (0 when it was not one)."""
        gap = elapsed_s - (self.interval if bound_s is None else bound_s)
        if gap <= self.threshold:
            return 0.0
        log.warning("router resumed after a stall", extra={"fields": {"stalled_s": round(gap, 1), "loop": self.name}})
        return gap


class StallAwareLoop:
    """A daemon thread (``router-<name>``) that calls ``step()`` every ``interval_s`` until ``stop()``, and
    ``resumed(stalled_s)`` before the step that follows a stall."""

    def __init__(self, interval_s: float, name: str):
        self._stop = threading.Event()
        self.stall = StallDetector(interval_s, name=name)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"router-{name}")

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def step(self) -> None:
        raise NotImplementedError

    def resumed(self, stalled_s: float) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            stopped, stalled = self.stall.wait(self._stop)
            if stopped:
                return
            if stalled:
                self.resumed(stalled)
            self.step()
