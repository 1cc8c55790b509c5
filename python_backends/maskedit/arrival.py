"""When a request now starting pre-processing arrived, at the earliest: the wait it already spent in Triton's queue.

Triton passes a Python model no arrival time, and a request's bound counts from its arrival
(``maskedit.completion``). Pre-processing has one instance, first come first served, and at most ``queue_size``
requests wait in front of it (``maskedit.repository.PREPROCESS_QUEUE``; Triton refuses the next at once). So when
a request arrived, at most ``queue_size - 1`` were waiting ahead of it and one was being pre-processed: it arrived no
earlier than the start of the ``queue_size``-th execution before its own. And it arrived after the instance last
sat idle: a gap longer than ``idle_gap_s`` between two executions means nothing was waiting then (Triton hands a
waiting request to an idle instance within milliseconds; 0.25 s leaves room for a loaded host). The later of the
two is the earliest it can have arrived; the wait is over-estimated (never under) when the executions before it
were back to back, which is when the queue was full anyway.
"""

from __future__ import annotations

import time
from collections import deque


class ArrivalBound:
    def __init__(self, queue_size: int, idle_gap_s: float = 0.25, now: float | None = None):
        self.queue_size, self.idle_gap_s = queue_size, idle_gap_s
        self._runs: deque[tuple[float, float]] = deque(maxlen=queue_size)  # (start, end) of the last executions
        self._ready = time.time() if now is None else now  # nothing reached the model before it was ready

    def earliest(self, start: float) -> float:
        """The earliest arrival of the request whose execution starts at ``start`` (``time.time()``)."""
        floor = self._runs[0][0] if len(self._runs) == self.queue_size else self._ready
        after = start
        for s, e in reversed(self._runs):  # newest first: the last idle gap before it
            if after - e > self.idle_gap_s:
                floor = max(floor, e)
                break
            after = s
        return min(start, floor)

    def ran(self, start: float, end: float) -> None:
        """An execution (of any request: admitted, refused or failed) ran from ``start`` to ``end``."""
        self._runs.append((start, end))
