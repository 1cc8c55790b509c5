"""Early admission: intake and pre-processing refuse a request at once while the denoise queue is full, or when it
could not be answered within its bound.

The denoise loop refuses a request when its queue is full, but only after pre-processing (image decoding, the
VAE and text encoders) has been spent on it. When requests arrive faster than they can be served, they also wait
in Triton's queue in front of pre-processing, so a refusal could come seconds after the request was sent. The
denoise process publishes its queue length in a small shared-memory file per server (named after the
``tritonserver`` pid, the parent of the stubs); intake (the ensemble's first step, ``maskedit.intake``) reads it (a
memory load) on arrival, and pre-processing again before any work, and they refuse with RESOURCE_EXHAUSTED while the
queue is full. The board also counts what waits in front of pre-processing (intake's passes less pre-processing's
starts), which intake keeps to ``maskedit.repository.PREPROCESS_WAITING``.

With tenants (``maskedit.fair_share``) a full queue still takes a request whose tenant holds less than the
heaviest tenant's share (it displaces that tenant's newest), so the board also carries the weighted share of the
``SLOTS`` heaviest tenants, and the check lets a lighter tenant's request through while the heaviest is refused.

The count is a backstop; the bound is a time (``maskedit.completion``). The denoise process also publishes its
backlog — each request in the batch and in the queue (steps left, tokens per step, the time it must be answered
by) and its step-time model as measured — after every step and every change of its queue, under a sequence lock
(pre-processing copies it and retries while a write is under way); ``vae_decode`` publishes its measured decoding
time. ``FrontCheck``, the first thing pre-processing does after the count, predicts from that when the request
would be answered and refuses it before any work when that is past its bound.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .arrival import Arrival, ArrivalBound, SentStamp
from .completion import Backlog, Bound, Ema, Loop, Work, bound_for, decide
from .errors import ResourceExhausted
from .fair_share import tenant_hash

# int64 fields, each written by one process only: waiting and max_queue (denoise: its queue), arrived (denoise:
# requests it has received), passed (pre-processing: requests it sent on towards denoise); then (denoise) the
# heaviest tenants' shares: SLOTS pairs of (tenant hash, share x 1000), 0 = an empty slot
_WAITING, _MAX, _ARRIVED, _PASSED = 0, 8, 16, 24
_SHARES, SLOTS = 32, 16
# the backlog (denoise, under the sequence number at _SEQ: odd while a write is under way): the step-time model
# (fixed s, s per token), the recent requests' mean tokens per step, how many in the batch and waiting; then one
# (steps left, tokens, answer by) per request, at most JOBS (the rest lumped into the last); and (vae_decode) the
# measured decoding time
_SEQ = _SHARES + 16 * SLOTS
_HEAD = struct.Struct("<dddqq")
_DECODE = _SEQ + 8 + _HEAD.size
_JOBS, JOBS = _DECODE + 8, 256
_JOB = struct.Struct("<qqd")
# what waits in front of pre-processing (``maskedit.intake``): requests intake passed on and those it wrote off as
# lost (intake writes), requests from intake that pre-processing started and since when it has been idle (0: busy;
# pre-processing writes). Appended: an older, shorter board grows through ``ftruncate``
_INTAKE_PASSED = _JOBS + _JOB.size * JOBS
_INTAKE_HEALED, _PRE_STARTED, _PRE_IDLE_SINCE = _INTAKE_PASSED + 8, _INTAKE_PASSED + 16, _INTAKE_PASSED + 24
_SIZE = _INTAKE_PASSED + 32


def board_path(directory: Path, server_pid: int | None = None) -> Path:
    """The board of server ``server_pid`` (default: this stub's parent, the ``tritonserver``) in ``directory``
    (``Settings.service.admission_dir``)."""
    return Path(directory) / f"server-{server_pid if server_pid is not None else os.getppid()}"


class QueueBoard:
    """The denoise queue as the denoise process last published it, shared with pre-processing. Requests that
    pre-processing has passed but denoise has not received yet count as queued: a burst is admitted only as far
    as the queue has room, so the rest are refused before pre-processing rather than after it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    def _get(self, off: int) -> int:
        return struct.unpack_from("<q", self._map, off)[0]

    def _set(self, off: int, value: int) -> None:
        struct.pack_into("<q", self._map, off, value)

    # -- the denoise process ----------------------------------------------------------------------------
    def publish(self, waiting: int, max_queue: int, shares: dict[str, float] | None = None) -> None:
        """The queue's length and limit, and (fair share on) each tenant's weighted share of it."""
        heaviest = sorted((shares or {}).items(), key=lambda kv: -kv[1])[:SLOTS]
        for i in range(SLOTS):
            h, v = (tenant_hash(heaviest[i][0]), round(heaviest[i][1] * 1000)) if i < len(heaviest) else (0, 0)
            self._set(_SHARES + 16 * i, h)
            self._set(_SHARES + 16 * i + 8, v)
        self._set(_WAITING, waiting)
        self._set(_MAX, max_queue)

    def arrived(self) -> None:
        self._set(_ARRIVED, self._get(_ARRIVED) + 1)

    # -- pre-processing -------------------------------------------------------------------------------------
    def queued(self) -> tuple[int, int]:
        """(requests waiting for denoise or on their way to it, the queue's limit)"""
        on_the_way = max(0, self._get(_PASSED) - self._get(_ARRIVED))
        return self._get(_WAITING) + on_the_way, self._get(_MAX)

    def shares(self) -> dict[int, float]:
        """Tenant hash -> weighted share of the queue, for the heaviest tenants (empty: fair share off)."""
        out = {}
        for i in range(SLOTS):
            h = self._get(_SHARES + 16 * i)
            if h:
                out[h] = self._get(_SHARES + 16 * i + 8) / 1000
        return out

    def check(self, tenant: str = "", weight: float = 1.0) -> None:
        """Raise ResourceExhausted while the denoise queue is full (limit 0: nothing published yet), unless
        ``tenant`` would hold less of it than the heaviest tenant (denoise then gives it that tenant's place)."""
        queued, max_queue = self.queued()
        if max_queue > 0 and queued >= max_queue:
            shares = self.shares()
            mine = shares.get(tenant_hash(tenant), 0.0) + 1.0 / weight
            if not shares or max(shares.values()) <= mine:
                raise ResourceExhausted(f"denoise queue is full ({queued} waiting); retry later")

    def passed(self) -> None:
        self._set(_PASSED, self._get(_PASSED) + 1)

    def on_the_way(self) -> int:
        """Requests pre-processing sent on that the denoise process has not received yet."""
        return max(0, self._get(_PASSED) - self._get(_ARRIVED))

    # -- in front of pre-processing (intake and pre-processing write, each its own fields) ------------------------
    def waiting_for_preprocess(self) -> int:
        """Requests intake passed on that pre-processing has not started (nor intake written off)."""
        return self._get(_INTAKE_PASSED) - self._get(_INTAKE_HEALED) - self._get(_PRE_STARTED)

    def intake_passed(self) -> None:
        self._set(_INTAKE_PASSED, self._get(_INTAKE_PASSED) + 1)

    def intake_healed(self, n: int) -> None:
        """``n`` requests intake passed on will never start pre-processing (a reload, a dead stub, a failed step)."""
        self._set(_INTAKE_HEALED, self._get(_INTAKE_HEALED) + n)

    def preprocess_started(self, from_intake: bool) -> None:
        """Pre-processing starts a request (``from_intake``: one intake counted): busy until ``preprocess_idle``."""
        if from_intake:
            self._set(_PRE_STARTED, self._get(_PRE_STARTED) + 1)
        struct.pack_into("<d", self._map, _PRE_IDLE_SINCE, 0.0)

    def preprocess_idle(self, since: float) -> None:
        struct.pack_into("<d", self._map, _PRE_IDLE_SINCE, since)

    def preprocess_idle_since(self) -> float:
        """When pre-processing last went idle (``time.time()``); 0: busy, or not started yet."""
        return struct.unpack_from("<d", self._map, _PRE_IDLE_SINCE)[0]

    # -- the backlog (denoise writes, pre-processing reads) --------------------------------------------------
    def publish_backlog(self, b: Backlog) -> None:
        jobs = list(b.running) + list(b.waiting)
        if len(jobs) > JOBS:  # what does not fit: one lump as long as the longest, as heavy as all of them
            rest = jobs[JOBS - 1:]
            jobs = jobs[:JOBS - 1] + [(max(j[0] for j in rest), sum(j[1] for j in rest), math.inf)]
        n_run = min(len(b.running), len(jobs))
        seq = self._get(_SEQ)
        seq += 0 if seq & 1 else 1  # odd: a write is under way (already odd: a writer died mid-write)
        self._set(_SEQ, seq)
        _HEAD.pack_into(self._map, _SEQ + 8, b.fixed_s, b.per_token_s, b.tokens, n_run, len(jobs) - n_run)
        if jobs:
            struct.pack_into("<" + "qqd" * len(jobs), self._map, _JOBS,
                             *(v for steps, tokens, by in jobs for v in (steps, tokens, by)))
        self._set(_SEQ, seq + 1)

    def backlog(self, tries: int = 50) -> Backlog | None:
        """The backlog as last published (None: nothing yet); a write under way is waited out (briefly)."""
        for attempt in range(tries):
            seq = self._get(_SEQ)
            if seq and not seq & 1:
                fixed, per_token, tokens, n_run, n_wait = _HEAD.unpack_from(self._map, _SEQ + 8)
                n = max(0, min(JOBS, n_run + n_wait))
                raw = struct.unpack_from("<" + "qqd" * n, self._map, _JOBS)
                if self._get(_SEQ) == seq:
                    jobs = [raw[i:i + 3] for i in range(0, 3 * n, 3)]
                    return Backlog(jobs[:n_run], jobs[n_run:], fixed, per_token, tokens)
            elif not seq:
                return None
            if attempt > 3:
                time.sleep(0.0005)
        return None

    def decoded(self, seconds: float) -> None:
        """``vae_decode``'s measured time per decoding."""
        struct.pack_into("<d", self._map, _DECODE, seconds)

    def decode_s(self) -> float:
        return struct.unpack_from("<d", self._map, _DECODE)[0]

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


@dataclass(frozen=True)
class Admitted:
    """A request the front let through: its earliest arrival (``time.time()``) and what says so, its bound (None:
    none) and when it was predicted to be answered (``vae_decode`` logs the prediction beside what happened)."""

    arrival: Arrival
    bound: Bound | None = None
    predicted_at: float | None = None


class FrontCheck:
    """Pre-processing's time check, before any work on a request: when would it be answered, behind the backlog the
    denoise loop published and what pre-processing sent on since? Refused (``maskedit.completion.refusal``) when
    that is past its bound, counted from its earliest possible arrival (``maskedit.arrival``: its sender's stamp,
    within ``skew_s`` when another host's clock, else inferred). Its own tokens are not known before decoding: the
    recent requests' mean stands in (the whole working resolution until there are any); its pre-processing takes
    what the last ones took (measured here)."""

    def __init__(self, board: QueueBoard, latency_bound_s: float, max_batch: int, max_tokens: int, full_tokens: int,
                 skew_s: float = 0.05):
        self.board, self.latency_bound_s = board, latency_bound_s
        self.max_batch, self.max_tokens, self.full_tokens = max_batch, max_tokens, full_tokens
        self.arrivals = ArrivalBound(skew_s=skew_s)
        self.prepare_s = Ema()  # a whole pre-processing (what an admitted request costs here)
        self._sent: deque = deque(maxlen=JOBS)  # (steps, tokens, answer by) of the requests sent on, newest last
        self._last = Backlog()

    def admit(self, start: float, steps: int, deadline_ms: int | None, sent: SentStamp | None = None,
              floor: float | None = None) -> Admitted:
        """What is known of a request whose pre-processing starts at ``start`` (``time.time()``), stamped ``sent``
        by its sender (None: unstamped), with ``floor`` its earliest arrival as intake inferred it (None: inferred
        here), and that runs ``steps`` steps, once admitted; raises the refusal."""
        arrival = self.arrivals.arrival(start, sent, floor)
        bound = bound_for(self.latency_bound_s, deadline_ms, start - arrival.at)
        if bound is None:
            return Admitted(arrival)
        b = self.board.backlog()
        self._last = b = b if b is not None else self._last
        now = time.time()
        rel = lambda job: Work(job[0], job[1], job[2] - now)  # noqa: E731
        n = min(self.board.on_the_way(), len(self._sent))
        on_the_way = list(self._sent)[len(self._sent) - n:] if n else []
        loop = Loop(b.step_s, self.max_batch, self.max_tokens, max(0.0, self.board.decode_s()))
        tokens = round(b.tokens) if b.tokens > 0 else self.full_tokens
        p, err = decide(loop, [rel(j) for j in b.running], [rel(j) for j in b.waiting + on_the_way],
                        Work(steps, tokens, bound.left - (now - start), ready_s=self.prepare_s.get()), bound)
        if err is not None:
            raise err
        return Admitted(arrival, bound, now + p.answer_s)

    def ran(self, start: float, end: float, prepared: bool) -> None:
        """A request's execution here ended; ``prepared``: it was pre-processed in full (admitted)."""
        self.arrivals.ran(start, end)
        if prepared:
            self.prepare_s.observe(end - start)

    def sent(self, steps: int, tokens: int, answer_by: float | None) -> None:
        """A request goes on towards denoising (before ``QueueBoard.passed``)."""
        self._sent.append((steps, tokens, math.inf if answer_by is None else answer_by))


def remove(directory: Path, server_pid: int) -> None:
    """Remove a server's board (the launcher does, when it stops or reaps the server)."""
    with contextlib.suppress(FileNotFoundError):
        board_path(directory, server_pid).unlink()
