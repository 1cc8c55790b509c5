"""The ensemble's first step: refuse at once what pre-processing could not take soon, and say when a request
arrived.

``intake`` (``maskedit.repository``) sees every request of the ``edit`` ensemble within about a millisecond of its
arrival: it is light (no torch, its only input the few bytes of PROMPT), has one instance and Triton's default
scheduler, which hands it a queued request as soon as it asks for the next (no batcher, no poll). For each request:

1. **When it arrived**: a lower bound from intake's own executions (``maskedit.arrival.ArrivalBound``), handed to
   pre-processing as INTAKE_INFO's ``floor_ts``. Pre-processing counts an unstamped request's wait from it, its wait
   in front of pre-processing included.
2. **What waits in front of pre-processing**: intake's passes less pre-processing's starts, two counters on the
   admission board (``maskedit.admission``). ``PREPROCESS_WAITING`` (16) already waiting: refused at once,
   RESOURCE_EXHAUSTED, before any work. What bounded that queue before, Triton's queue policy, paced
   pre-processing 0.5 s apart (docs/reliability.md, "In front of pre-processing").
3. **The denoise queue full** (``QueueBoard.check``): refused at once too.

A pass that never reaches pre-processing (a reload, a dead stub, a step that failed to enqueue) would count as
waiting for ever: once pre-processing has been idle longer than the idle gap, nothing intake passed before that gap
is still waiting (a queued request starts within it), so intake writes off what the count holds beyond its own
recent passes.
"""

from __future__ import annotations

import json
import math
from collections import deque

from .admission import QueueBoard
from .arrival import IDLE_GAP_S, ArrivalBound
from .errors import ResourceExhausted
from .repository import PREPROCESS_WAITING


class Intake:
    def __init__(self, board: QueueBoard, max_waiting: int = PREPROCESS_WAITING, idle_gap_s: float = IDLE_GAP_S,
                 now: float | None = None):
        self.board, self.max_waiting, self.idle_gap_s = board, max_waiting, idle_gap_s
        self.arrivals = ArrivalBound(idle_gap_s, clock="", now=now)
        self._passes: deque[float] = deque()  # when intake passed its recent requests on (within the idle gap)

    def waiting(self, now: float) -> int:
        """Requests waiting in front of pre-processing (or on their way to it), after writing off lost passes."""
        while self._passes and self._passes[0] < now - self.idle_gap_s:
            self._passes.popleft()
        waiting = self.board.waiting_for_preprocess()
        idle = self.board.preprocess_idle_since()
        recent = len(self._passes)
        # below 0 only after a pass written off that then started: the count cannot be negative
        if waiting < 0 or (idle > 0 and now - idle > self.idle_gap_s and waiting > recent):
            keep = max(0, min(waiting, recent))
            self.board.intake_healed(waiting - keep)
            waiting = keep
        return waiting

    def decide(self, start: float, tenant: str = "", weight: float = 1.0) -> dict:
        """INTAKE_INFO for a request whose execution starts at ``start`` (``time.time()``), for ``tenant`` of
        ``weight``; raises ResourceExhausted when pre-processing's queue or the denoise queue is full."""
        floor = self.arrivals.earliest(start)
        waiting = self.waiting(start)
        if waiting >= self.max_waiting:
            raise ResourceExhausted(f"pre-processing's queue is full ({waiting} waiting; refused on arrival, before "
                                    "any work): send again later or to another server")
        self.board.check(tenant, weight)
        self.board.intake_passed()  # before the answer: pre-processing may start it at once
        self._passes.append(start)
        return {"floor_ts": floor, "received_ts": start, "waiting": waiting}

    def ran(self, start: float, end: float) -> None:
        """An execution (passed or refused) ran from ``start`` to ``end``."""
        self.arrivals.ran(start, end)


def floor_of(info) -> float | None:
    """The arrival floor INTAKE_INFO carries (its JSON text, as bytes or a one-element array); None: anything else."""
    try:
        raw = info.reshape(-1)[0] if hasattr(info, "reshape") and info.size == 1 else info
        floor = json.loads(raw).get("floor_ts")
    except (ValueError, TypeError, AttributeError):
        return None
    ok = isinstance(floor, (int, float)) and not isinstance(floor, bool) and math.isfinite(floor) and floor >= 0
    return float(floor) if ok else None
