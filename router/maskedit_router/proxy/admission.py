"""Admission in the router: refuse at once when no backend could reach a new request's admission check soon, and
refuse on the backend's behalf a request that has waited too long in front of that check.

A backend refuses what it cannot queue (its denoise queue is full) at its admission check, the first thing
pre-processing does (``maskedit.admission``). In front of that check is Triton's queue for the ``preprocess``
model: when pre-processing falls behind (a busy host), requests wait there and a refusal can come seconds after the
request was sent. The backend's ``intake`` (the ensemble's first step, ``maskedit.intake``) keeps at most 16 there,
refusing the rest on arrival; those refusals never reach pre-processing, so its statistics never count them. The router sends every request, so it can tell which of its requests on a
backend are still in front of that check (``AdmissionGauge``): pre-processing takes them first come, first served,
so those past it are always the oldest. It learns how far the check got from Triton's own statistics of the
``preprocess`` model (``ModelStatistics``: success and failure counts, kept by Triton in C++ with no Python stub
involved; polled every 0.05 s over the backend's gRPC channel while router edits wait in front of its check or it is
refusing, every second otherwise: ``AdmissionWatcher``), and sooner from the backend's answers (a refusal at
the check answers at once; an answered request and every older one are past it). The same statistics give what the
check costs per request (compute time per request over the recent mix of admitted and refused ones). One bound,
``wait_s`` (0.6 s), is the longest an edit may wait in front of a check — while the backend is refusing (it, or the
router on its behalf, refused within ``refusing_s``, 5 s; or it holds as many of the router's edits past its check as
when it last refused by itself, within a minute of that refusal). A backend that admits what reaches it is left alone however
long its queue: what waits there will be served, and refusing it would turn away work with capacity free.

1. **Where to send.** A request sent to b now reaches the check after about ``waiting(b) x per_request(b)``. The
   router sends an edit to b only while that is within ``wait_s``, or fewer than ``min_window`` (2) requests wait
   (one in the check, one ready behind it, so pre-processing never idles for want of work), or the check's cost is
   not measured yet (the backstop bounds those), and not
   while its check has made no progress for longer than ``wait_s`` (a stalled or starved backend: what waits there
   now will be refused below anyway). When no backend admits, the edit is refused at once with RESOURCE_EXHAUSTED
   on its own stream.
2. **The backstop.** A prediction is only as good as the host: on a starved CPU one pre-processing took 0.9 s where
   the cost measured just before said 0.05. So any edit still in front of the check, except the oldest (which may
   be in it right now), that has waited ``wait_s`` is refused by the router with RESOURCE_EXHAUSTED and cancelled
   on the backend (the ``cancel`` model; pre-processing drops a cancelled request before any work). Every refusal
   through the router then comes within about ``wait_s`` plus one poll, however slow the backend is. (The stream
   session moves it to another backend instead when one has room: ``_StreamSession.expire``.)

The backend's own check still decides whether the denoise queue has room; this keeps the queue in front of that
check short, so its refusals come quickly too, while keeping pre-processing busy: what it serves is unchanged, what
it would refuse late is refused early.

What can go wrong, and which way: the check may reach an edit within the last poll, or before the cancel lands,
and the router refuses one that then passes the check (the denoise loop drops it: wasted work, still one answer;
counted as ``admitted`` in ``maskedit_router_admission_timeout_outcome_total``); decisions the backend counts that
are not the router's (the health probe, other clients) mark the router's oldest waiting edits as past the check —
at worst one is exempt from the backstop (for the first edits sent to a backend polled at the idle pace, the decisions
of up to one idle poll interval before them count so); a decision learnt from an answer that the count never shows (a request refused before
pre-processing: by the backend's intake, or an older server's Triton queue policy) is forgotten after 2 s; a restarted backend's counters start at 0 and everything is taken as
past the check; a backend never observed (no statistics yet, no ``preprocess`` model, the watcher not running) is
admitted as before and nothing on it expires. After the router itself was stopped (``stall``), its counts are as
old as the stall and every wait it measured includes it: each gauge starts again from the next poll, as after a
backend's restart (a resumed router once refused what the stall alone had made look stuck). (A first version counted only ``sent - finished``: when younger
requests were refused at the check and answered before the next poll, the count-based window slid back onto older,
admitted requests, and the router refused those — late, and wrongly.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

import grpc
from tritonclient.grpc import service_pb2

from .stall import StallAwareLoop

log = logging.getLogger("maskedit.router")


@dataclass
class _Sent:
    sent_at: float  # monotonic
    on_expire: Callable[[], bool] | None  # refuses it on its own stream (None: it cannot be refused later)
    expired: bool = False  # refused by the router; still in the backend's queue until the backend answers
    decided: bool = False  # known to be past the check (admitted or refused there)


class AdmissionGauge:
    """One backend's queue in front of its admission check as the router sees it: its edits in flight there, in the
    order sent, each known to be past the check or not. Pre-processing takes them first come, first served, so
    what passes the check is always the oldest of those not yet past it. Two sources say so: the backend's count
    of requests its check finished (a poll behind), and the backend's answers — an answer (a refusal at the check,
    or any other end) means that request and every older one are past the check, and a poll that then counts those
    decisions must not pass them on to younger requests. Not thread-safe: the router calls it under its lock."""

    def __init__(self, wait_s: float = 0.6, min_window: int = 2, executing: int = 1, alpha: float = 0.1,
                 early_ttl_s: float = 2.0, refusing_s: float = 5.0, full_memory_s: float = 60.0):
        self.wait_s, self.min_window = wait_s, min_window  # wait_s 0: off (the backend decides alone)
        self.executing = executing  # requests the check may be running at once (``preprocess`` instances)
        self.alpha = alpha  # weight of one request's cost in ``per_request_s``
        self.early_ttl_s = early_ttl_s  # how long a decision learnt from an answer waits for the count to show it
        self.entries: OrderedDict[str, _Sent] = OrderedDict()  # the router's edits on it, in the order sent
        self.undecided = 0  # entries not known to be past the check
        self.early: deque = deque()  # times of decisions learnt from answers that the count has not shown yet
        self.sent = 0  # edits the router sent to this backend
        self.decided: int | None = None  # the backend's own count of requests its check finished (None: never seen)
        self.busy_ns = 0  # the backend's own count of time spent in pre-processing, matching ``decided``
        self.per_request_s: float | None = None  # what the check costs per request, recent mix (exponential average)
        self.moved_at = 0.0  # monotonic time the check last made progress, or last had nothing waiting
        self.observed_at: float | None = None  # monotonic time of the latest statistics
        self.refusing_s = refusing_s  # how long after the backend's last refusal it counts as refusing
        self.refused_at = float("-inf")  # monotonic time the backend last refused a request (RESOURCE_EXHAUSTED)
        # What the backend held when it last refused by itself: the router's edits past its check and not answered
        # (queued for or in its denoise loop, or decoding). Holding as many again within ``full_memory_s`` of that
        # refusal, it is taken as refusing before it says so (the onset of the next burst).
        self.full_at: int | None = None
        self.own_refused_at = float("-inf")
        self.full_memory_s = full_memory_s

    # -- counting -------------------------------------------------------------------------------------
    def waiting(self) -> int:
        """Edits sent that the backend's check has not finished (0 until its statistics are seen)."""
        return self.undecided if self.decided is not None else 0

    def _pass(self, n: int, now: float, early: bool = False) -> None:
        """The ``n`` oldest edits not yet past the check are past it (``early``: learnt before the count shows it)."""
        if n <= 0:
            return
        for e in self.entries.values():
            if n <= 0:
                break
            if not e.decided:
                e.decided, n = True, n - 1
                self.undecided -= 1
                if early:
                    self.early.append(now)
        self.moved_at = now

    def on_sent(self, key: str, now: float, on_expire: Callable[[], bool] | None = None) -> None:
        if self.undecided == 0:
            self.moved_at = now  # the check had nothing to do: the new request's wait starts now
        self.sent += 1
        self.entries[key] = _Sent(now, on_expire)
        self.undecided += 1

    def ended(self, key: str, answered: bool = True, now: float | None = None) -> None:
        """``key``'s request is over for the router. ``answered``: the backend sent its final answer, so it and
        every older edit are past the check. Otherwise (the router let go of it: retried elsewhere, the client gone,
        refused by the router) one the router refused (expired) stays counted until the backend answers it: it is
        still in the backend's queue."""
        e = self.entries.get(key)
        if e is None or (not answered and e.expired):
            return
        now = time.monotonic() if now is None else now
        if answered and not e.decided:  # first come, first served: everything sent before it is past the check too
            older = 0
            for k, x in self.entries.items():
                if k == key:
                    break
                older += not x.decided
            self._pass(older + 1, now, early=True)
        del self.entries[key]
        if not e.decided:
            self.undecided -= 1

    def observe(self, decided: int, busy_ns: int, now: float) -> None:
        """The backend's statistics: ``decided`` requests finished by its check so far, ``busy_ns`` spent on them."""
        if self.decided is None or decided < self.decided:  # first sight, or a restart (counters from 0)
            for key in [k for k, e in self.entries.items() if e.expired]:
                del self.entries[key]  # a restarted backend will never answer them
            for e in self.entries.values():
                e.decided = True  # nothing known to wait
            self.undecided, self.early = 0, deque()
            self.decided, self.busy_ns, self.moved_at, self.observed_at = decided, busy_ns, now, now
            return
        n = decided - self.decided
        if n > 0:
            sample = max(0, busy_ns - self.busy_ns) / n / 1e9
            weight = 1.0 - (1.0 - self.alpha) ** n
            self.per_request_s = sample if self.per_request_s is None else \
                self.per_request_s + weight * (sample - self.per_request_s)
            while self.early and now - self.early[0] > self.early_ttl_s:
                self.early.popleft()  # never counted (rejected by Triton before pre-processing): forget it
            known = min(n, len(self.early))
            for _ in range(known):
                self.early.popleft()  # decisions already learnt from answers
            self._pass(n - known, now)  # more than the router's own: other clients' or the probe's, ignored
            self.moved_at = now
        self.decided, self.busy_ns, self.observed_at = decided, busy_ns, now
        if self.undecided == 0:
            self.moved_at = now

    def resumed(self) -> None:
        """The router was stopped: what it counted is stale and its waits include the stall. Until the next poll
        the backend is treated as never observed (admitted, nothing expires); that poll starts the count again,
        everything in flight taken as past the check."""
        self.decided = None

    def past_check(self) -> int:
        """The router's edits on this backend past its check and not answered yet."""
        return len(self.entries) - self.undecided

    def backend_refused(self, now: float) -> None:
        """The backend answered a request with RESOURCE_EXHAUSTED (its denoise queue is full)."""
        self.refused_at = self.own_refused_at = now
        self.full_at = max(1, self.past_check())

    def refused_for(self, now: float) -> None:
        """The router refused a request on this backend's behalf. That keeps it refusing: while the router refuses
        what would queue in front of the check, the backend itself refuses little or nothing, and a state that
        lapsed after ``refusing_s`` without the backend's own refusals let the queue grow back in sustained
        overload (measured: a burst of refusals 1.7-3.2 s late, 58 s into a 2x run)."""
        self.refused_at = max(self.refused_at, now)

    def refusing(self, now: float) -> bool:
        """The backend refused a request within ``refusing_s``: what waits in front of its check may be refused
        there too. While it admits everything, what waits will be served, however long it waits: the router then
        refuses nothing on its behalf. Also refusing: a backend holding as many of the router's edits past its check
        as when it last refused by itself, within ``full_memory_s`` of that refusal (measured: at the onset of a
        burst, before its first refusal, what had queued in front of its check was refused there up to 1.7 s late)."""
        if now - self.refused_at <= self.refusing_s:
            return True
        return self.full_at is not None and now - self.own_refused_at <= self.full_memory_s and \
            self.past_check() >= self.full_at

    def expire(self, now: float) -> list[tuple[str, Callable[[], bool]]]:
        """Mark expired, and return (key, refuse), every edit in front of the check, behind the one that may be
        running, that has waited ``wait_s``, by what the router knows now (the latest count and every answer since).
        If the check reached one of them within the last poll, it is refused here anyway and the backend drops it
        (cancelled): a refusal, never a second answer. Only while the backend is refusing."""
        if self.decided is None or self.wait_s <= 0 or not self.refusing(now):
            return []
        out = []
        ahead = 0
        for key, e in self.entries.items():
            if e.decided:
                continue
            ahead += 1
            if ahead <= self.executing:
                continue  # it may be in the check right now (and admitted)
            if not e.expired and e.on_expire is not None and now - e.sent_at >= self.wait_s:
                e.expired = True
                out.append((key, e.on_expire))
        return out

    def unexpire(self, key: str) -> None:
        """``key`` could not be refused after all (it had ended or streamed meanwhile)."""
        e = self.entries.get(key)
        if e is not None:
            e.expired = False

    # -- the decision ---------------------------------------------------------------------------------
    def predicted_wait_s(self) -> float:
        """How long an edit sent now would wait before the backend's check (0 when not known). Requests the router
        refused there are dropped by the check without work."""
        if self.decided is None:
            return 0.0
        live = sum(1 for e in self.entries.values() if not e.decided and not e.expired)
        return live * (self.per_request_s or 0.0)

    def stalled_s(self, now: float) -> float:
        """How long requests have waited in front of the check without it finishing any (0 if none wait)."""
        return max(0.0, now - self.moved_at) if self.waiting() > 0 else 0.0

    def admits(self, now: float) -> bool:
        if self.decided is None or self.wait_s <= 0 or not self.refusing(now):
            return True  # never observed, admission in the router off, or a backend that admits what reaches it
        if self.stalled_s(now) > self.wait_s:
            return False
        if self.waiting() < self.min_window or self.per_request_s is None:
            return True  # (cost not measured yet: the backstop bounds what waits)
        return self.predicted_wait_s() <= self.wait_s

    def view(self, now: float) -> dict:
        """For /health and the refusal message."""
        return {"waiting": self.waiting(), "in_flight": len(self.entries),
                "per_request_ms": None if self.per_request_s is None else round(self.per_request_s * 1000, 1),
                "predicted_wait_s": round(self.predicted_wait_s(), 3), "stalled_s": round(self.stalled_s(now), 3),
                "admits": self.admits(now), "refusing": self.refusing(now), "full_at": self.full_at,
                "observed": self.decided is not None,
                "counts_age_s": None if self.observed_at is None else round(now - self.observed_at, 3)}


def counts(resp, model: str = "preprocess") -> tuple[int, int] | None:
    """(requests finished, nanoseconds spent on them) by ``model`` from a ModelStatistics response (every
    version summed), or None if it has no such model."""
    stats = [m for m in resp.model_stats if m.name == model]
    if not stats:
        return None
    done = sum(m.inference_stats.success.count + m.inference_stats.fail.count for m in stats)
    busy = sum(m.inference_stats.compute_input.ns + m.inference_stats.compute_infer.ns +
               m.inference_stats.compute_output.ns for m in stats)
    return done, busy


class AdmissionWatcher(StallAwareLoop):
    """Polls the backends' ``preprocess`` statistics (asynchronously: a backend that does not answer delays no
    other) and feeds them to their ``AdmissionGauge``s: every ``interval_s`` a backend with router edits in front of
    its check or one that is refusing, every ``idle_interval_s`` the others. The counts are read only while a
    backend is refusing (``admits`` and ``expire`` return early otherwise), and a backend starts refusing by an
    answer (its own refusal) or the router's decision, both seen at once; so an idle backend's counts serve only as
    the base of its next busy spell, which the fast polls that spell brings keep current. (Every backend polled 20
    times a second: a gRPC call and a thread start each, most of the router's idle third of a core at 32 backends by
    an estimate from the code, and of the emulated instances' CPU; docs/router.md.)"""

    def __init__(self, router, interval_s: float = 0.05, model: str = "preprocess", timeout_s: float = 1.0,
                 idle_interval_s: float = 1.0):
        super().__init__(interval_s, "admission")
        self.r, self.interval, self.model, self.timeout = router, interval_s, model, timeout_s
        self.idle_interval = max(interval_s, idle_interval_s)
        self._inflight: dict[str, object] = {}  # backend address -> its statistics call in flight
        self._polled_at: dict[str, float] = {}  # backend address -> monotonic time of its latest poll
        self._missing: set[str] = set()  # backends without the model (logged once)

    def resumed(self, stalled_s: float) -> None:
        self.r.admission_resumed()
        self._polled_at.clear()  # every gauge starts again from its next poll: the next tick, for all

    def step(self) -> None:
        self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """Poll what is due, then refuse on time what waited too long in front of a check (``expire_admissions``:
        also between answers, so a slow statistics call does not delay it). A backend with nothing of the router's
        waiting in front of its check has nothing to expire."""
        waiting, refusing = self.r.admission_activity(now)
        busy = {b.addr for b in waiting} | {b.addr for b in refusing}
        backends = list(self.r.backends.values())
        if len(self._polled_at) > len(backends):  # backends removed since: forget them
            self._polled_at = {b.addr: self._polled_at[b.addr] for b in backends if b.addr in self._polled_at}
        idle = [b for b in backends if b.addr not in busy and
                now - self._polled_at.get(b.addr, float("-inf")) >= self.idle_interval]
        self.poll([*waiting, *refusing], now, pace="fast")
        self.poll(idle, now, pace="idle")
        for b in waiting:
            self.r.expire_admissions(b)

    def poll(self, backends=None, now: float | None = None, pace: str = "fast") -> None:
        """Ask ``backends`` (default: every one) for their statistics; one still answering the last call is
        skipped."""
        now = time.monotonic() if now is None else now
        request = service_pb2.ModelStatisticsRequest(name=self.model)
        asked = 0
        for b in list(self.r.backends.values()) if backends is None else backends:
            if b.addr in self._inflight:
                continue
            try:
                call = b.stub.ModelStatistics.future(request, timeout=self.timeout)
            except Exception as e:  # a closed channel (the backend was removed): nothing to watch
                log.debug("admission: cannot ask %s: %s", b.addr, e)
                continue
            self._inflight[b.addr], self._polled_at[b.addr] = call, now
            asked += 1
            call.add_done_callback(lambda c, b=b: self._answered(b, c))
        metrics = getattr(self.r, "metrics", None)
        if asked and metrics is not None:
            metrics.admission_polled(pace, asked)

    def _answered(self, backend, call) -> None:
        self._inflight.pop(backend.addr, None)
        try:
            got = counts(call.result(), self.model)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                got = None  # no such model: admission stays with the backend
            else:
                return  # down or slow: the health checker's business; the gauge keeps counting sends
        except Exception:  # cancelled on shutdown
            return
        if got is None:
            if backend.addr not in self._missing:
                self._missing.add(backend.addr)
                log.warning("admission: backend has no model to watch; it alone decides",
                            extra={"fields": {"backend": backend.addr, "model": self.model}})
            return
        self.r.observe_admission(backend, *got)


class RefusalLog:
    """One structured log line when the router starts refusing for a reason, then one every ``every_s`` with the
    count while it goes on (a 2x overload refuses many requests a second)."""

    def __init__(self, every_s: float = 5.0):
        self.every = every_s
        self._since: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def note(self, reason: str, detail: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            first, n = self._since.get(reason, (None, 0))
            if first is None or now - first >= self.every:
                self._since[reason] = (now, 0)
                log.warning("refusing requests", extra={"fields": {"reason": reason, "detail": detail,
                                                                   "refused_since_last_line": n + 1}})
            else:
                self._since[reason] = (first, n + 1)
