"""Admission in the router: refuse at once when no backend could reach a new request's admission check soon, and
refuse on the backend's behalf a request that has waited too long in front of that check.

A backend refuses what it cannot queue (its denoise queue is full) at its admission check, the first thing
pre-processing does (``maskedit.admission``). In front of that check is Triton's queue for the ``preprocess``
model, which has no bound: when pre-processing falls behind (a busy host), requests wait there and a refusal can
come seconds after the request was sent. The router sends every request, so it can tell how much waits in front
of each backend's check:

    waiting(b) = edit requests the router sent to b - requests b's pre-processing has finished (admitted or not)

the second from Triton's own statistics of the ``preprocess`` model (``ModelStatistics``: its success and failure
counts, kept by Triton in C++ with no Python stub involved), polled every 0.05 s over the backend's gRPC channel;
the same statistics give what the check costs per request (compute time per request over the recent mix of
admitted and refused ones). One bound, ``wait_s`` (0.6 s), the longest an edit may wait in front of a check:

1. **Where to send.** A request sent to b now reaches the check after about ``waiting(b) x per_request(b)``. The
   router sends an edit to b only while that is within ``wait_s``, or fewer than
   ``min_window`` (2) requests wait (one in the check, one ready behind it, so pre-processing never idles for want
   of work; also the limit while the check's cost is not measured yet, e.g. on a backend that has not served since
   the router started), and not while its check has made no progress for longer than ``wait_s`` (a stalled or
   starved backend: what waits there now will be refused below anyway). When no backend admits, the edit is
   refused at once with RESOURCE_EXHAUSTED on its own stream. (A tighter budget than ``wait_s`` refused more than
   it had to: the counts arrive a poll late, and a window of two or three requests then let pre-processing run
   dry; on this host it served ~15 % less than the router without admission.)
2. **The backstop.** A prediction is only as good as the host: on a starved CPU one pre-processing took 0.9 s where
   the cost measured just before said 0.05. So the router keeps its edits in flight on each backend in the order it
   sent them; pre-processing runs them first come, first served, so the newest ``waiting(b)`` of them are those
   its check has not reached. Any of those, except the oldest (which may be in the check right now), that has
   waited ``wait_s`` is refused by the router with RESOURCE_EXHAUSTED and cancelled on the backend (the ``cancel``
   model; pre-processing drops a cancelled request before any work). Every refusal through the router then comes
   within about ``wait_s`` plus one poll (0.05 s), however slow the backend is.

The backend's own check still decides whether the denoise queue has room; this keeps the queue in front of that
check short, so its refusals come quickly too, while keeping pre-processing busy: what it serves is unchanged
(near capacity), what it would refuse late is refused early. The router's requests keep their order per backend
stream; requests from other clients (or the health probe) make the backend's count run ahead, which at worst
exempts a request from the backstop, never refuses one the check has passed.

Counting is self-correcting: ``waiting`` is kept between 0 and the router's edits in flight on the backend (a
restarted backend's counters start again at 0; other clients' requests make its count run ahead), so an error
never accumulates; a backend never observed (no statistics yet, no ``preprocess`` model, the watcher not running)
is admitted as before and nothing on it expires.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import grpc
from tritonclient.grpc import service_pb2

log = logging.getLogger("maskedit.router")


@dataclass
class _Sent:
    sent_at: float  # monotonic
    on_expire: Callable[[], None] | None  # refuses it on its own stream (None: it cannot be refused later)
    expired: bool = False  # refused by the router; still in the backend's queue until the backend answers


class AdmissionGauge:
    """One backend's queue in front of its admission check as the router counts it. Not thread-safe: the router
    calls it under its lock."""

    def __init__(self, wait_s: float = 0.6, min_window: int = 2, executing: int = 1, alpha: float = 0.1):
        self.wait_s, self.min_window = wait_s, min_window  # wait_s 0: off (the backend decides alone)
        self.executing = executing  # requests the check may be running at once (``preprocess`` instances)
        self.alpha = alpha  # weight of one request's cost in ``per_request_s``
        self.entries: OrderedDict[str, _Sent] = OrderedDict()  # the router's edits on it, in the order sent
        self.sent = 0  # edits the router sent to this backend
        self.decided: int | None = None  # the backend's own count of requests its check finished (None: never seen)
        self.busy_ns = 0  # the backend's own count of time spent in pre-processing, matching ``decided``
        self.offset = 0  # correction of ``sent - decided`` (see ``_recount``)
        self.per_request_s: float | None = None  # what the check costs per request, recent mix (exponential average)
        self.moved_at = 0.0  # monotonic time the check last made progress, or last had nothing waiting
        self.observed_at: float | None = None  # monotonic time of the latest statistics

    # -- counting -------------------------------------------------------------------------------------
    def waiting(self) -> int:
        """Edits sent that the backend's check has not finished: between 0 and the router's edits on it."""
        if self.decided is None:
            return 0
        return min(len(self.entries), max(0, self.sent - self.decided - self.offset))

    def _undecided(self) -> list:
        """(key, entry) of the edits the check has not reached or is running: the newest ``waiting`` (FIFO)."""
        w = self.waiting()
        return list(self.entries.items())[len(self.entries) - w:] if w else []

    def _recount(self) -> None:
        """Bring ``sent - decided - offset`` back within [0, edits in flight]: the backend counted requests the
        router did not send (health probes, other clients), restarted with fresh counters, or answered requests
        without running them (rejected by Triton before pre-processing)."""
        w = self.sent - self.decided - self.offset
        if w < 0:
            self.offset += w
        elif w > len(self.entries):
            self.offset += w - len(self.entries)

    def on_sent(self, key: str, now: float, on_expire: Callable[[], None] | None = None) -> None:
        if self.decided is not None and self.waiting() == 0:
            self.moved_at = now  # the check had nothing to do: the new request's wait starts now
        self.sent += 1
        self.entries[key] = _Sent(now, on_expire)

    def ended(self, key: str, answered: bool = True) -> None:
        """``key``'s request is over for the router. One it refused itself (expired) stays counted until the
        backend answers it (``answered``): it is still in the backend's queue."""
        e = self.entries.get(key)
        if e is not None and (answered or not e.expired):
            del self.entries[key]  # ``waiting`` is capped by the entries at once; the offset moves only on fresh counts

    def observe(self, decided: int, busy_ns: int, now: float) -> None:
        """The backend's statistics: ``decided`` requests finished by its check so far, ``busy_ns`` spent on them."""
        if self.decided is None or decided < self.decided:  # first sight, or a restart (counters from 0)
            for key in [k for k, e in self.entries.items() if e.expired]:
                del self.entries[key]  # a restarted backend will never answer them
            self.decided, self.busy_ns, self.moved_at = decided, busy_ns, now
            self.offset = self.sent - decided  # nothing known to wait
            self.observed_at = now
            return
        n = decided - self.decided
        if n > 0:
            sample = max(0, busy_ns - self.busy_ns) / n / 1e9
            weight = 1.0 - (1.0 - self.alpha) ** n
            self.per_request_s = sample if self.per_request_s is None else \
                self.per_request_s + weight * (sample - self.per_request_s)
            self.moved_at = now
        self.decided, self.busy_ns, self.observed_at = decided, busy_ns, now
        self._recount()
        if self.waiting() == 0:
            self.moved_at = now

    def expire(self, now: float) -> list[tuple[str, Callable[[], None]]]:
        """Mark expired, and return (key, refuse), every edit in front of the check, behind the one that may be
        running, that has waited ``wait_s``. Call right after ``observe`` (fresh counts)."""
        if self.decided is None or self.wait_s <= 0:
            return []
        out = []
        for key, e in self._undecided()[self.executing:]:
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
        live = sum(1 for _, e in self._undecided() if not e.expired)
        return live * (self.per_request_s or 0.0)

    def stalled_s(self, now: float) -> float:
        """How long requests have waited in front of the check without it finishing any (0 if none wait)."""
        return max(0.0, now - self.moved_at) if self.waiting() > 0 else 0.0

    def admits(self, now: float) -> bool:
        if self.decided is None or self.wait_s <= 0:
            return True  # never observed, or admission in the router is off: the backend decides alone
        if self.stalled_s(now) > self.wait_s:
            return False
        if self.waiting() < self.min_window:
            return True
        # what the check costs is not measured yet (a backend that has not served since the router started):
        # no more than the window, or a burst at start-up would all queue behind a cold pre-processing
        return self.per_request_s is not None and self.predicted_wait_s() <= self.wait_s

    def view(self, now: float) -> dict:
        """For /health and the refusal message."""
        return {"waiting": self.waiting(), "in_flight": len(self.entries),
                "per_request_ms": None if self.per_request_s is None else round(self.per_request_s * 1000, 1),
                "predicted_wait_s": round(self.predicted_wait_s(), 3), "stalled_s": round(self.stalled_s(now), 3),
                "admits": self.admits(now), "observed": self.decided is not None}


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


class AdmissionWatcher:
    """Polls every backend's ``preprocess`` statistics (asynchronously: a backend that does not answer delays no
    other) and feeds them to its ``AdmissionGauge``."""

    def __init__(self, router, interval_s: float = 0.05, model: str = "preprocess", timeout_s: float = 1.0):
        self.r, self.interval, self.model, self.timeout = router, interval_s, model, timeout_s
        self._stop = threading.Event()
        self._inflight: dict[str, object] = {}  # backend address -> its statistics call in flight
        self._missing: set[str] = set()  # backends without the model (logged once)
        self._thread = threading.Thread(target=self._run, daemon=True, name="router-admission")

    def start(self) -> "AdmissionWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        request = service_pb2.ModelStatisticsRequest(name=self.model)
        for b in list(self.r.backends.values()):
            if b.addr in self._inflight:
                continue
            try:
                call = b.stub.ModelStatistics.future(request, timeout=self.timeout)
            except Exception as e:  # a closed channel (the backend was removed): nothing to watch
                log.debug("admission: cannot ask %s: %s", b.addr, e)
                continue
            self._inflight[b.addr] = call
            call.add_done_callback(lambda c, b=b: self._answered(b, c))

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
