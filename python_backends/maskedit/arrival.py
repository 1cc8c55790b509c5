"""When a request now starting pre-processing arrived, at the earliest: the wait it already spent in Triton's queue.

Triton passes a Python model no arrival time, and a request's bound counts from its arrival
(``maskedit.completion``). Pre-processing has one instance, first come first served, and at most ``queue_size``
requests wait in front of it (``maskedit.repository.PREPROCESS_QUEUE``; Triton refuses the next at once). So when
a request arrived, at most ``queue_size - 1`` were waiting ahead of it and one was being pre-processed: it arrived no
earlier than the start of the ``queue_size``-th execution before its own. And it arrived after the instance last
sat idle: a gap longer than ``idle_gap_s`` between two executions means nothing was waiting until just before the
next one began (Triton hands a waiting request to an idle instance within milliseconds; 0.25 s leaves room for a
loaded host), so whoever started then or later arrived after that. The later of the two is the earliest it can
have arrived; the wait is over-estimated (never under) when the executions before it
were back to back, which is when the queue was full anyway.
"""

from __future__ import annotations

import time
from collections import deque


class ArrivalBound:
    def __init__(self, queue_size: int, idle_gap_s: float = 0.25, now: float | None = None):
        self.queue_size, self.idle_gap_s = queue_size, idle_gap_s
        # (start, end) of the last executions; the first stands for the model becoming ready (nothing reached it
        # before), until ``queue_size`` real ones push it out
        ready = time.time() if now is None else now
        self._runs: deque[tuple[float, float]] = deque([(ready, ready)], maxlen=queue_size)

    def earliest(self, start: float) -> float:
        """The earliest arrival of the request whose execution starts at ``start`` (``time.time()``)."""
        floor = self._runs[0][0]  # the queue_size-th execution before it (or the model's start)
        after = start
        for s, e in reversed(self._runs):  # newest first: the last idle gap before it
            if after - e > self.idle_gap_s:  # idle until ``after``: whoever started then or later came after
                floor = max(floor, after - self.idle_gap_s)
                break
            after = s
        return min(start, floor)

    def ran(self, start: float, end: float) -> None:
        """An execution (of any request: admitted, refused or failed) ran from ``start`` to ``end``."""
        self._runs.append((start, end))
