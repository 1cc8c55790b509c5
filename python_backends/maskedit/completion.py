"""Admission by predicted completion time: a request is taken only if it can be answered within its bound.

Every request is answered (a result) or refused within its bound of its arrival: the server's
``MASKEDIT_LATENCY_BOUND_S``, or the request's own ``DEADLINE_MS`` when that is shorter. The count bounds on the
queues (16 in front of pre-processing, ``MASKEDIT_MAX_QUEUE`` in front of denoising) stop a flood but say nothing of
time: with 4 in the batch and 8 waiting, each edit several seconds, a request that got in was answered 20-40 s
later. So each decision predicts when the request would be answered and refuses it, before any work on it, when
that is past its bound.

The prediction (``answer_times``) runs the work ahead through a model of the denoise loop: the requests in the
batch with their remaining steps, then those waiting and those pre-processed and on their way, first come first
served, each joining the batch when a place is free (``max_batch``, ``max_tokens``); a step of the batch costs what
the step-time model says for the tokens it computes — a model refitted online from the loop's real step times
(``maskedit.scheduler.StepTimeModel``), so a loaded host's slowdown is in it; then decoding, one request at a time,
at its measured time. A request still being pre-processed joins when that is done (``ready_s``).

The same decision (``refusal``) is taken three times, each with what is known there:
- at the front, the first thing pre-processing does, before decoding (``maskedit.admission``'s board: the batch
  and queue as the denoise loop last published them, plus what pre-processing sent on since; the request's own
  tokens are not known yet: the recent requests' mean stands in). Its arrival is not known either (Triton passes no
  timestamp to a Python model): ``maskedit.arrival`` bounds the wait in front of pre-processing from below;
- when the denoise loop receives it (its tokens now exact, the loop's own state);
- when it reaches the front of the denoise queue (``maskedit.scheduler``): a request that waited so long that it can
  no longer be answered in time is refused then, never started and answered late.

A newcomer is refused when it would be answered late, and when it would make a request already taken late (it
shares the batch's steps with them; on a CPU a step's time grows with the batch's tokens). What the model leaves
out: requests of a lighter tenant go ahead of a heavier one's (``maskedit.fair_share``) and ``priority`` reorders;
both only move work earlier for some and later for others, and the check when a request reaches the front of the
queue catches who was pushed too late.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .errors import DeadlineExceeded, EditError, ResourceExhausted

SERVER_BOUND = "MASKEDIT_LATENCY_BOUND_S"  # the names a refusal gives for the bound it applied
CLIENT_BOUND = "DEADLINE_MS"


@dataclass(frozen=True)
class Work:
    """One request as the prediction sees it; times in seconds from now."""

    steps: int  # denoising steps it has left
    tokens: int  # image tokens it computes per step
    answer_by: float = math.inf  # its bound: answered by then (inf: none)
    ready_s: float = 0.0  # when it can join the batch (still being pre-processed until then)


@dataclass(frozen=True)
class Loop:
    """What the denoise loop does with work: ``step_s(tokens)`` is a step's time for a batch computing that many
    tokens (the online step-time model); its batch limits; one decoding's time (measured in ``vae_decode``)."""

    step_s: Callable[[int], float]
    max_batch: int
    max_tokens: int = 1 << 62
    decode_s: float = 0.0


def answer_times(loop: Loop, running: list[Work], waiting: list[Work]) -> list[float]:
    """Seconds from now until each request is answered, ``running`` then ``waiting`` in their order: the batch runs
    to its next event (a request finishing, or one in pre-processing becoming ready while the batch has room) at the
    current batch's step time; finished requests are decoded one at a time in the order they finished."""
    n_run = len(running)
    rem = {i: w.steps for i, w in enumerate(running)}
    batch = list(range(n_run))
    queue = deque(range(n_run, n_run + len(waiting)))
    work = list(running) + list(waiting)
    done = [0.0] * len(work)
    t = 0.0
    while batch or queue:
        tokens = sum(work[i].tokens for i in batch)
        while queue and len(batch) < loop.max_batch and work[queue[0]].ready_s <= t and \
                (not batch or tokens + work[queue[0]].tokens <= loop.max_tokens):
            i = queue.popleft()
            batch.append(i)
            rem[i] = work[i].steps
            tokens += work[i].tokens
        if not batch:  # nothing runs until the next request is pre-processed
            t = work[queue[0]].ready_s
            continue
        step = max(1e-9, loop.step_s(tokens))
        k = min(rem[i] for i in batch)
        if queue and len(batch) < loop.max_batch and work[queue[0]].ready_s > t:  # it joins at the next boundary
            k = min(k, max(1, math.ceil((work[queue[0]].ready_s - t) / step)))
        t += k * step
        for i in list(batch):
            rem[i] -= k
            if rem[i] <= 0:
                done[i] = t
                batch.remove(i)
    answered, free = [0.0] * len(work), 0.0
    for i in sorted(range(len(work)), key=lambda i: done[i]):
        free = answered[i] = max(done[i], free) + loop.decode_s
    return answered


@dataclass
class Backlog:
    """The denoise loop's work as it publishes it (``maskedit.admission``'s board): (steps left, tokens per step, answer by: ``time.time()``, inf for
    none) per request in the batch and waiting, in its order; its step-time model; the recent requests' mean tokens
    per step (0: none seen yet)."""

    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    fixed_s: float = 0.0
    per_token_s: float = 0.0
    tokens: float = 0.0

    def step_s(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True)
class Bound:
    """A request's bound: ``seconds`` after its arrival, ``spent`` of them already gone (it waited), named by
    ``source`` (``SERVER_BOUND`` or ``CLIENT_BOUND``)."""

    seconds: float
    spent: float
    source: str

    @property
    def left(self) -> float:
        return self.seconds - self.spent


def bound_for(latency_bound_s: float, deadline_ms: int | None, spent: float) -> Bound | None:
    """The tighter of the server's bound (0: none) and the request's DEADLINE_MS, or None when neither is set."""
    options = [(latency_bound_s, SERVER_BOUND)] if latency_bound_s > 0 else []
    if deadline_ms:
        options.append((deadline_ms / 1000.0, CLIENT_BOUND))
    if not options:
        return None
    seconds, source = min(options)
    return Bound(seconds, spent, source)


@dataclass(frozen=True)
class Prediction:
    """``answer_s``: when the newcomer would be answered (seconds from now); ``delays``: the requests ahead of it
    (indices into running + waiting) it would make late that are in time without it; ``over_s``: by how much the
    latest of those, or itself, would miss."""

    answer_s: float
    delays: tuple[int, ...]
    over_s: float


def predict(loop: Loop, running: list[Work], waiting: list[Work], new: Work) -> Prediction:
    """``new`` appended behind ``waiting``: when it would be answered, and whom it would make late."""
    times = answer_times(loop, running, waiting + [new])
    ahead = running + waiting
    late = [i for i, w in enumerate(ahead) if times[i] > w.answer_by]
    if late:
        before = answer_times(loop, running, waiting)
        late = [i for i in late if before[i] <= ahead[i].answer_by]  # those late anyway change nothing
    over = max([times[-1] - new.answer_by] + [times[i] - ahead[i].answer_by for i in late])
    return Prediction(times[-1], tuple(late), over)


def refusal(loop: Loop, running: list[Work], waiting: list[Work], new: Work, bound: Bound,
            where: str = "refused before any work") -> EditError | None:
    """The error refusing ``new`` (appended behind ``waiting``, its ``answer_by`` = ``bound.left``), or None to
    admit it (``decide``)."""
    return decide(loop, running, waiting, new, bound, where)[1]


def decide(loop: Loop, running: list[Work], waiting: list[Work], new: Work, bound: Bound,
           where: str = "refused before any work") -> tuple[Prediction, EditError | None]:
    """The prediction for ``new`` and the error refusing it, or None to admit it. Refused when it would be answered
    past its bound, or would make a request already taken (one predicted in time without it) late. Its own
    DEADLINE_MS that it misses even with nothing ahead of it: DEADLINE_EXCEEDED (retrying cannot help); otherwise
    RESOURCE_EXHAUSTED with when to retry."""
    p = predict(loop, running, waiting, new)
    step_ms = 1000 * loop.step_s(new.tokens)
    if p.answer_s <= new.answer_by:
        if not p.delays:
            return p, None
        return p, ResourceExhausted(
            f"would delay {len(p.delays)} requests already taken past their bounds (it would share their batch's "
            f"steps, ~{step_ms:.0f} ms each measured now); {where}; retry in ~{_retry_s(p.over_s)} s or send it to "
            "another server")
    ahead = len(running) + len(waiting)
    spent = f", {bound.spent:.1f} s of them spent waiting" if bound.spent >= 0.05 else ""
    alone = answer_times(loop, [], [new])[0]
    if bound.source == CLIENT_BOUND and alone > new.answer_by:
        return p, DeadlineExceeded(
            f"cannot be answered within {1000 * bound.seconds:.0f} ms of its arrival{spent}: ~{1000 * alone:.0f} ms "
            f"of work with nothing ahead of it ({new.steps} steps at ~{step_ms:.0f} ms measured now); {where}",
            CLIENT_BOUND)
    why = f"{ahead} requests ahead of it" if ahead else "nothing ahead of it"
    return p, ResourceExhausted(
        f"cannot be answered within {bound.seconds:g} s of its arrival ({_name(bound.source)}{spent}): ~"
        f"{bound.spent + p.answer_s:.1f} s predicted, {why}, ~{step_ms:.0f} ms a step measured now; {where}; "
        f"retry in ~{_retry_s(p.over_s)} s or send it to another server")


def _name(source: str) -> str:
    return "its DEADLINE_MS" if source == CLIENT_BOUND else f"the server's bound, {SERVER_BOUND}"


def _retry_s(excess: float) -> int:
    """When the work ahead will have drained enough for it to fit (the excess of its predicted answer time)."""
    return max(1, math.ceil(excess))


class Ema:
    """An exponential moving average of measured seconds (or counts), each sample counted as at most ``clamp``
    times the average (as ``maskedit.scheduler.StepTimeModel``): one outlier (a process stopped) moves it by at most
    ``1 + alpha * (clamp - 1)`` times; frequent slow samples count in full once it has risen with them."""

    def __init__(self, alpha: float = 0.2, clamp: float = 20.0, value: float | None = None):
        self.alpha, self.clamp, self.value = alpha, clamp, value

    def observe(self, x: float) -> None:
        if x < 0 or not math.isfinite(x):
            return
        if self.value is None:
            self.value = x
            return
        if self.value > 0:
            x = min(x, self.clamp * self.value)
        self.value += self.alpha * (x - self.value)

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value
