"""Admission in the router: refuse at once when no backend could reach a new request's admission check soon.

A backend refuses what it cannot queue (its denoise queue is full) at its admission check, the first thing
pre-processing does (``maskedit.admission``). In front of that check is Triton's queue for the ``preprocess``
model, which has no bound: when pre-processing falls behind (a busy host), requests wait there and a refusal can
come seconds after the request was sent. The router sends every request, so it can tell how much waits in front
of each backend's check:

    waiting(b) = edit requests the router sent to b - requests b's pre-processing has finished (admitted or not)

the second from Triton's own statistics of the ``preprocess`` model (``ModelStatistics``: its success and failure
counts, kept by Triton in C++ with no Python stub involved), polled every 0.1 s over the backend's gRPC channel;
the same statistics give what the check costs per request (compute time per request over the recent mix of
admitted and refused ones). A request sent to b now reaches the check after about

    wait(b) = waiting(b) x per_request(b)

The router sends to b only while wait(b) is within the budget (``wait_budget_s``, 0.5 s: half the 1 s refusal
target, the rest for the poll's lag, the check itself and the way back), or fewer than ``min_window`` (2)
requests wait (one in the check, one ready behind it, so pre-processing never idles for want of work), and not
while its check has made no progress for longer than the budget (a stalled or starved backend: the per-request
cost measured before no longer holds). When no backend admits, the request is refused at once with
RESOURCE_EXHAUSTED on its own stream. The backend's own check still decides whether the denoise queue has room;
this only keeps the queue in front of that check short, so its refusals come quickly too, while keeping
pre-processing busy: what it serves is unchanged (near capacity), what it would refuse late is refused early.

Counting is self-correcting: ``waiting`` is kept between 0 and the backend's requests in flight through the router
(a restarted backend's counters start again at 0; requests from other clients or the health probe make the
backend's count run ahead), so an error never accumulates; a backend never observed (no statistics yet, no
``preprocess`` model, the watcher not running) is admitted as before.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
from tritonclient.grpc import service_pb2

log = logging.getLogger("maskedit.router")


@dataclass
class AdmissionGauge:
    """One backend's admission queue as the router counts it. Not thread-safe: the router calls it under its
    lock."""

    wait_budget_s: float = 0.5
    min_window: int = 2
    sent: int = 0  # edit requests the router sent to this backend
    decided: int | None = None  # the backend's own count of requests its check has finished (None: never seen)
    busy_ns: int = 0  # the backend's own count of time spent in pre-processing, matching ``decided``
    offset: int = 0  # correction of ``sent - decided`` (see ``_recount``)
    per_request_s: float | None = None  # what the check costs per request, recent mix (exponential average)
    moved_at: float = 0.0  # monotonic time the check last made progress, or last had nothing waiting
    observed_at: float | None = None  # monotonic time of the latest statistics
    alpha: float = 0.1  # weight of one request's cost in ``per_request_s``

    # -- counting -------------------------------------------------------------------------------------
    def waiting(self, inflight: int | None = None) -> int:
        """Requests sent that the backend's check has not finished: at least 0, at most ``inflight`` (the
        router's requests in flight on it) when given."""
        if self.decided is None:
            return 0
        w = max(0, self.sent - self.decided - self.offset)
        return w if inflight is None else min(w, max(0, inflight))

    def _recount(self, inflight: int | None) -> None:
        """Bring ``sent - decided - offset`` back within [0, inflight]: the backend counted requests the router did
        not send (health probes, other clients) or restarted with fresh counters."""
        w = self.sent - self.decided - self.offset
        if w < 0:
            self.offset += w
        elif inflight is not None and w > max(0, inflight):
            self.offset += w - max(0, inflight)

    def on_sent(self, now: float) -> None:
        if self.decided is not None and self.waiting() == 0:
            self.moved_at = now  # the check had nothing to do: the new request's wait starts now
        self.sent += 1

    def observe(self, decided: int, busy_ns: int, now: float, inflight: int | None = None) -> None:
        """The backend's statistics: ``decided`` requests finished by its check so far, ``busy_ns`` spent on them."""
        if self.decided is None or decided < self.decided:  # first sight, or a restart (counters from 0)
            self.decided, self.busy_ns, self.moved_at = decided, busy_ns, now
            self.offset = self.sent - decided  # nothing known to wait; ``inflight`` caps it below anyway
            self._recount(inflight)
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
        self._recount(inflight)
        if self.waiting(inflight) == 0:
            self.moved_at = now

    # -- the decision ---------------------------------------------------------------------------------
    def predicted_wait_s(self, inflight: int | None = None) -> float:
        """How long a request sent now would wait before the backend's check (0 when not known)."""
        return self.waiting(inflight) * (self.per_request_s or 0.0)

    def stalled_s(self, now: float, inflight: int | None = None) -> float:
        """How long requests have waited in front of the check without it finishing any (0 if none wait)."""
        return max(0.0, now - self.moved_at) if self.waiting(inflight) > 0 else 0.0

    def admits(self, now: float, inflight: int | None = None) -> bool:
        if self.decided is None or self.wait_budget_s <= 0:
            return True  # never observed, or admission in the router is off: the backend decides alone
        if self.stalled_s(now, inflight) > self.wait_budget_s:
            return False
        return self.waiting(inflight) < self.min_window or self.predicted_wait_s(inflight) <= self.wait_budget_s

    def view(self, now: float, inflight: int | None = None) -> dict:
        """For /health and the refusal message."""
        return {"waiting": self.waiting(inflight),
                "per_request_ms": None if self.per_request_s is None else round(self.per_request_s * 1000, 1),
                "predicted_wait_s": round(self.predicted_wait_s(inflight), 3),
                "stalled_s": round(self.stalled_s(now, inflight), 3), "admits": self.admits(now, inflight),
                "observed": self.decided is not None}


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

    def __init__(self, router, interval_s: float = 0.1, model: str = "preprocess", timeout_s: float = 1.0):
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
