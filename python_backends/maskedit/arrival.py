"""When a request now starting pre-processing arrived: what its bound (``maskedit.completion``) counts from.

Triton passes a Python model no arrival time, and a request can have waited seconds in Triton's queue in front of
pre-processing. Two sources, the first that applies:

1. **Its sender's stamp** (``maskedit_common.sent_stamp``: our client stamps a request as it sends it, the router as
   it receives it). Stamped on this host's clock (the sender's boot id is ours) it is the arrival, exactly. Another
   host's clock is believed within ``skew_s`` (``MASKEDIT_CLOCK_SKEW_S``): the request was sent no earlier than
   ``stamp - skew_s``. A stamp later than the start of pre-processing by more than that is no time it was sent (a
   clock running ahead): set aside for (2). A stamp is its sender's claim: a wrong one misstates the wait of its own
   requests only, as its DEADLINE_MS could.
2. **Inferred** from pre-processing's own executions (a client that stamps nothing: perf_analyzer, tritonclient),
   a lower bound: the wait is over-counted, never under.
   - By count: Triton refuses a request when ``queue_size`` wait (``maskedit.repository.PREPROCESS_QUEUE``), and its
     rate limiter takes up to 2 more out of the queue for the instance ahead of time (``PayloadSlotAvailable``: twice
     the instances), so at most ``queue_size + 2`` were ahead of a request when it arrived, one of them maybe
     executing: it arrived no earlier than the start of the ``queue_size + 3``-th execution before its own.
   - By idle time: a gap longer than ``idle_gap_s`` between two executions means nothing was waiting until
     ``idle_gap_s`` before the next one began, so whoever started then or later arrived after that. The gap must
     exceed the longest Triton takes to hand a waiting request to an idle instance: its dynamic batcher (which holds
     the queue policy) re-checks its queue every 500 ms when it was not woken (``default_wait_microseconds`` in
     ``dynamic_batch_scheduler.cc``), and in a flood it left the instance idle 0.44-0.51 s between executions with
     15 requests waiting (``tests/unit/maskedit/test_arrival.py`` replays one). The 0.25 s assumed before read
     those gaps as an empty queue: 48 requests with a 1.5 s DEADLINE_MS were admitted as fresh after waiting up to
     6 s and answered late. 1 s: twice the poll, for a loaded host's scheduling; a request after a quiet spell is
     charged up to that much waiting it did not do (a stamp avoids it).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass

from maskedit_common.sent_stamp import SENT_AT, SENT_CLOCK, host_clock

from .errors import InvalidInput

IDLE_GAP_S = 1.0
PREFETCHED = 2  # requests Triton's rate limiter takes out of the queue ahead of the one instance


@dataclass(frozen=True)
class SentStamp:
    at: float  # the sender's time.time() when it sent the request
    clock: str = ""  # the sender host's boot id ("": unknown, another host's)


@dataclass(frozen=True)
class Arrival:
    """``at``: the earliest the request arrived (``time.time()``); ``source``: what says so (EDIT_INFO, logs);
    ``note``: why a stamp was set aside, for the log ("" none)."""

    at: float
    source: str
    note: str = ""


STAMP, STAMP_OTHER_HOST, INFERRED = "sender's stamp", "sender's stamp, another host's clock", "inferred"


def sent_stamp(parameters: str | dict | None) -> SentStamp | None:
    """The request's stamp from its parameters (Triton gives the Python backend a JSON string); None: unstamped."""
    p = json.loads(parameters) if isinstance(parameters, str) else (parameters or {})
    at, clock = p.get(SENT_AT), p.get(SENT_CLOCK, "")
    if at is None:
        return None
    try:
        at = float(at) if isinstance(at, (int, float, str)) and not isinstance(at, bool) else math.nan
    except ValueError:
        at = math.nan
    if not math.isfinite(at) or at < 0:
        raise InvalidInput("must be the time the request was sent, in seconds since the epoch", SENT_AT)
    if not isinstance(clock, str) or len(clock) > 64:
        raise InvalidInput("must be the sending host's boot id (at most 64 characters)", SENT_CLOCK)
    return SentStamp(at, clock)


class ArrivalBound:
    def __init__(self, queue_size: int, idle_gap_s: float = IDLE_GAP_S, skew_s: float = 0.05,
                 clock: str | None = None, now: float | None = None):
        self.queue_size, self.idle_gap_s, self.skew_s = queue_size, idle_gap_s, skew_s
        self.clock = host_clock() if clock is None else clock
        # (start, end) of the last executions; the first stands for the model becoming ready (nothing reached it
        # before), until enough real ones push it out
        ready = time.time() if now is None else now
        self._runs: deque[tuple[float, float]] = deque([(ready, ready)], maxlen=queue_size + PREFETCHED + 1)

    def arrival(self, start: float, sent: SentStamp | None = None) -> Arrival:
        """The earliest arrival of the request whose execution starts at ``start`` (``time.time()``), stamped
        ``sent`` by its sender (None: unstamped)."""
        if sent is not None:
            same = bool(self.clock) and sent.clock == self.clock
            at = sent.at if same else sent.at - self.skew_s
            if at <= start:
                return Arrival(at, STAMP if same else STAMP_OTHER_HOST)
            note = (f"its sender's stamp is {sent.at - start:.3f} s after it reached pre-processing "
                    f"({'this host' if same else 'another host'}'s clock): set aside, the wait inferred")
            return Arrival(self.earliest(start), INFERRED, note)
        return Arrival(self.earliest(start), INFERRED)

    def earliest(self, start: float) -> float:
        """The earliest arrival inferred from the executions before ``start`` (module docstring, 2)."""
        floor = self._runs[0][0]  # the (queue_size + 3)-th execution before it (or the model's start)
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
