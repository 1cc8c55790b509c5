"""When a request now starting pre-processing arrived: what its bound (``maskedit.completion``) counts from.

Triton passes a Python model no arrival time, and a request can have waited seconds in Triton's queue in front of
pre-processing. Two sources, the first that applies:

1. **Its sender's stamp** (``maskedit_common.sent_stamp``: our client stamps a request as it sends it, the router as
   it receives it). Stamped on this host's clock (the sender's boot id is ours) it is the arrival, exactly. Another
   host's clock is believed within ``skew_s`` (``MASKEDIT_CLOCK_SKEW_S``): the request was sent no earlier than
   ``stamp - skew_s``. A stamp later than the start of pre-processing by more than that is no time it was sent (a
   clock running ahead): set aside for (2). A stamp is its sender's claim: a wrong one misstates the wait of its own
   requests only, as its DEADLINE_MS could.
2. **Inferred** (a client that stamps nothing: perf_analyzer, tritonclient), a lower bound: the wait is
   over-counted, never under. In the ``edit`` ensemble ``intake`` infers it (``maskedit.intake``: it runs ~1 ms per
   request, so the bound is tight) and hands it to pre-processing as INTAKE_INFO's ``floor_ts``; a direct call to
   pre-processing is inferred there, from its own executions, by the same rule. Neither model has a batcher
   (``maskedit.repository``): Triton's default scheduler hands a queued request to the model's instance as soon as it
   asks for the next, so a gap longer than ``idle_gap_s`` (G) between the end of one execution and the start of the
   next means nothing was waiting then, and whoever starts after such a gap arrived at most G before. Requests start
   in arrival order, so every request of a busy run (executions with no such gap between them) arrived no earlier
   than G before the run's first one began: the floor is ``start - G`` after an idle gap, else ``busy since - G``.
   Under back-to-back load that charges a request the whole busy run (a stamp avoids it; intake's runs last
   milliseconds). G must exceed the longest Triton takes to hand a waiting request to an idle instance: 0.25 s,
   pending a measurement on a quiet and a loaded host (docs/reliability.md, "Arrival").

Before, ``preprocess`` carried Triton's queue policy, and the dynamic batcher that holds a policy re-polls its queue
every 500 ms when it is not woken (``default_wait_microseconds``): in a flood it left the instance idle 0.44-0.51 s
between executions with 15 requests waiting, so an idle-gap rule needed G = 1 s there, plus a count rule (at most 16
queued and 2 taken ahead of the instance). Both went with the policy.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from maskedit_common.sent_stamp import SENT_AT, SENT_CLOCK, host_clock

from .errors import InvalidInput

IDLE_GAP_S = 0.25  # G (module docstring, 2): longer than any hand-over of a waiting request to an idle instance


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
    """A request's earliest arrival, from its sender's stamp or inferred from one model's executions (module
    docstring): O(1) state, the start of the current busy run and the end of the last execution."""

    def __init__(self, idle_gap_s: float = IDLE_GAP_S, skew_s: float = 0.05, clock: str | None = None,
                 now: float | None = None):
        self.idle_gap_s, self.skew_s = idle_gap_s, skew_s
        self.clock = host_clock() if clock is None else clock
        # the model's becoming ready stands for the first run: nothing reached it before
        self.ready = time.time() if now is None else now
        self.busy_since = self.last_end = self.ready

    def arrival(self, start: float, sent: SentStamp | None = None, floor: float | None = None) -> Arrival:
        """The earliest arrival of the request whose execution starts at ``start`` (``time.time()``), stamped
        ``sent`` by its sender (None: unstamped); ``floor``: a lower bound inferred before it reached this model
        (intake's), used instead of inferring one here."""
        inferred = min(start, floor) if floor is not None else self.earliest(start)
        if sent is not None:
            same = bool(self.clock) and sent.clock == self.clock
            at = sent.at if same else sent.at - self.skew_s
            if at <= start:
                return Arrival(at, STAMP if same else STAMP_OTHER_HOST)
            note = (f"its sender's stamp is {sent.at - start:.3f} s after it reached pre-processing "
                    f"({'this host' if same else 'another host'}'s clock): set aside, the wait inferred")
            return Arrival(inferred, INFERRED, note)
        return Arrival(inferred, INFERRED)

    def earliest(self, start: float) -> float:
        """The earliest arrival inferred from the executions before ``start`` (module docstring, 2)."""
        after = start if start - self.last_end > self.idle_gap_s else self.busy_since
        return min(start, max(self.ready, after - self.idle_gap_s))

    def ran(self, start: float, end: float) -> None:
        """An execution (of any request: admitted, refused or failed) ran from ``start`` to ``end``."""
        if start - self.last_end > self.idle_gap_s:  # idle before it: a new busy run
            self.busy_since = start
        self.last_end = max(self.last_end, end)
