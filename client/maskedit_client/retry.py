"""When and how soon a failed edit is sent again (the client and the router share the rule).

An edit that failed with UNAVAILABLE before any response was streamed for it never produced anything its caller
saw, and an edit is idempotent given its seed: it is sent again, after an exponential backoff with jitter, until the
request's own deadline. One that had streamed a response is never replayed (its caller would see it twice).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("maskedit.retry")


def retryable(code: str, responded: bool) -> bool:
    return code == "UNAVAILABLE" and not responded


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.1
    max_s: float = 2.0
    factor: float = 2.0
    jitter: float = 0.5  # each wait is drawn from [1 - jitter, 1] x the exponential step: retries spread out

    def delay(self, attempt: int, rand: float | None = None) -> float:
        step = min(self.max_s, self.first_s * self.factor ** attempt)
        return step * (1.0 - self.jitter * (random.random() if rand is None else rand))

    def next(self, attempt: int, deadline: float, now: float, rand: float | None = None) -> float | None:
        """The wait before retry ``attempt`` (0: the first), or None when the retry could not start before
        ``deadline`` (monotonic seconds)."""
        d = self.delay(attempt, rand)
        return d if now + d < deadline else None


class Timer:
    """Runs delayed calls on one daemon thread, so a retry waiting out its backoff holds no thread of its own."""

    def __init__(self, name: str = "maskedit-retry"):
        self.name = name
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self.name)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                log.exception("a delayed call failed")
