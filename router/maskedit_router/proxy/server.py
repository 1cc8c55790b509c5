"""The router: a ``GRPCInferenceService`` server that forwards every call to one backend Triton and relays
every response back, so tritonclient and perf_analyzer work against it unchanged.

Streams: the router keeps one stream per backend, shared by every client stream (``backend_streams.BackendStreams``,
closed after a while with nothing on it); request ids are remapped to ids unique across the router and mapped back on
the way out (error texts included). The router asks backends for the empty final
response so it always knows when a request ended, and drops it again if the client did not ask for it.
Reliability: a request that has had no response yet is retried on another backend when its backend's stream
breaks, its backend is found unhealthy or answers that it cannot run requests (a dead stub); one that has streamed
responses is never replayed and ends with a clear error. Cancelling the client
stream calls each backend's ``cancel`` model with the abandoned ids (Triton 2.51
does not forward a cancel into an ensemble step). Bounded in-flight per backend and overall, and admission
(``admission.py``): an edit goes only to a backend predicted to reach its admission check within the admission wait;
when none would, or every backend is at its in-flight limit, it is refused at once with RESOURCE_EXHAUSTED; a
streamed edit still waiting in front of a backend's check after the admission wait is refused by the router with
RESOURCE_EXHAUSTED and cancelled on the backend.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
import weakref

import grpc
from tritonclient.grpc import service_pb2_grpc

from maskedit_client.retry import Backoff, Timer
from maskedit_common.triton_refusals import as_refusal

from ..access.auth import ANONYMOUS
from ..access.tenancy import OverLimit, Quotas, tag_request
from ..metrics import RouterMetrics
from ..placement.features import MASK_RATIOS, EditFeatures, edit_info, routing_features
from ..placement.policies import Booking, Estimator, Policy
from .admission import RefusalLog
from .backend import (FINAL, Backend, NoBackend, Ticket,  # noqa: F401 (tests use them here)
                      _cancel_on_backend, backend_fault)
from .forwarded_calls import ForwardedCalls, _timeout
from .stamp import stamp
from .backend_streams import BackendStreams

log = logging.getLogger("maskedit.router")


class Router(ForwardedCalls, service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, addrs: list[str], policy: Policy, estimator: Estimator, metrics: RouterMetrics | None = None,
                 max_inflight_per_backend: int = 32, max_inflight: int = 256, template_ttl_s: float = 300.0,
                 resolution: int = 1024, admission_wait_s: float = 0.6, retry_budget_s: float = 30.0,
                 backend_key: str | None = None, backend_stream_idle_s: float = 30.0):
        self.backend_key = backend_key  # sent on every call to a backend (``backend_guard``); None: they are open
        self.admission = {"wait_s": admission_wait_s}  # 0: no admission in the router, each backend decides alone
        self.store_capacity = (16, 64)  # template entries in a backend's memory and disk tiers (its store's shadow)
        self.backends = {a: self._backend(a) for a in addrs}
        self.resolution = resolution  # the served model's working resolution: masks are measured on its token grid
        self.policy, self.est = policy, estimator
        self.metrics = metrics or RouterMetrics()
        self.metrics.registry.register(MASK_RATIOS)  # its hits and misses, read at each scrape
        self.max_per_backend, self.max_inflight, self.ttl = max_inflight_per_backend, max_inflight, template_ttl_s
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._sessions: weakref.WeakSet = weakref.WeakSet()  # open client streams
        self._unary: set = set()  # (backend, call future) of unary calls in flight
        self.refusals = RefusalLog()
        # a request that found no backend up (none healthy, or every one failed it before it streamed anything) is
        # retried with backoff for its DEADLINE_MS, else for retry_budget_s (0: failed at once, as before)
        self.retry_budget_s, self.backoff = retry_budget_s, Backoff()
        self.timer = Timer("router-retry")
        # one stream per backend, shared by every client stream, closed after backend_stream_idle_s with nothing on it
        self.backend_streams = BackendStreams(self, backend_stream_idle_s)
        # who may send how much (access.tenancy): per-key limits, and the fair queue in front of the backends
        # (None: off)
        self.quotas = Quotas()
        self.fair = None

    def tenant_refused(self, tenant, e: OverLimit) -> None:
        self.metrics.tenant_refused(tenant.name, e.reason)
        self.refusals.note(e.reason, f"tenant {tenant.name}: {e}")

    def backend_down(self, backend: "Backend", why: str) -> None:
        """``backend`` was found unhealthy while its streams may still be open (a stub that accepts requests and
        never answers): every stream request on it ends now, retried elsewhere if it had no response yet, else
        failed, exactly as if its stream had broken; its unary calls are retried elsewhere."""
        self.backend_streams.drop(backend)
        for session in list(self._sessions):
            session.abandon(backend, why)
        with self._lock:
            calls = [c for b, c in self._unary if b is backend]
        for call in calls:  # ModelInfer retries them elsewhere
            call.cancel()

    def backend_broken(self, backend: "Backend", why: str) -> None:
        """``backend`` answered that it cannot run requests (its stub died): out of rotation for the cool-down at
        once, and its requests end now, as ``backend_down``."""
        log.warning("backend %s is broken: %s", backend.addr, why)
        backend.trip()
        self.backend_down(backend, why)

    # -- backend set --------------------------------------------------------------------------------
    def set_backends(self, addrs: list[str]) -> None:
        with self._lock:
            for a in addrs:
                if a not in self.backends:
                    self.backends[a] = self._backend(a)
            removed = [self.backends.pop(a) for a in [a for a in self.backends if a not in addrs]]
        for b in removed:  # its requests end now, retried on the others: closing its channel cancels their calls
            self.backend_down(b, "removed from the backend set")
            b.close()

    def _backend(self, addr: str) -> Backend:
        b = Backend(addr, admission=self.admission, key=self.backend_key)
        b.load.mem_templates, b.load.disk_templates = self.store_capacity
        return b

    def available(self, exclude=()) -> list[Backend]:
        now = time.monotonic()
        with self._lock:
            return [b for b in self.backends.values() if b.available(now) and b.addr not in exclude]

    # -- routing and accounting ---------------------------------------------------------------------
    def route(self, f: EditFeatures, exclude=(), key: str | None = None, on_expire=None,
              room_only: bool = False) -> Ticket:
        """A backend for ``f``. ``key`` (a request id unique in the router) enters an edit the router sends itself
        in the chosen backend's admission gauge; ``on_expire`` refuses it on its stream (returns whether it did)
        if it waits too long in front of the backend's check. ``room_only``: only a backend with room — one that has
        not refused anything lately (``AdmissionGauge.refusing``) and is below its in-flight limit — for a request
        another backend just refused; none: ``NoBackend`` (its refusal stands; in an overload, where every backend
        refuses, a second wait in front of another check would only make the refusal late)."""
        t0 = time.perf_counter()
        cands = self.available(exclude)
        if not cands:
            raise NoBackend(grpc.StatusCode.UNAVAILABLE, "no healthy backend")
        now = time.monotonic()
        with self._lock:
            if room_only:
                cands = [b for b in cands if b.load.inflight < self.max_per_backend and not b.admission.refusing(now)]
                if not cands:
                    raise NoBackend(grpc.StatusCode.RESOURCE_EXHAUSTED, "no other backend has room")
            total = sum(b.load.inflight for b in self.backends.values())
            if total >= self.max_inflight:
                raise self._refuse("inflight_total", f"router has {total} requests in flight")
            open_ = [b for b in cands if b.load.inflight < self.max_per_backend]
            if not open_:
                raise self._refuse("inflight_backend", "every backend is at its in-flight limit")
            edit = f.runs_edit  # only edits pass the backends' admission check (pre-processing)
            if edit:
                admitting = [b for b in open_ if b.admission.admits(now)]
                if not admitting:
                    for b in open_:
                        b.admission.refused_for(now)
                    raise self._refuse("admission", "no backend can admit it within "
                                       f"{self.admission['wait_s']:g} s: " + _admission_summary(open_, now))
                open_ = admitting
            by_load = {b.load.name: b for b in open_}
            choice = by_load[self.policy.choose([b.load for b in open_], f, now).name]
            booking = Booking.add(choice.load, self.est, f, now, self.ttl)
            if edit and key is not None:
                choice.admission.on_sent(key, now, on_expire)
        self.metrics.decision(self.policy.name, choice.addr, time.perf_counter() - t0)
        return Ticket(choice, f, booking, key=key if edit else None)

    def _refuse(self, reason: str, message: str) -> "NoBackend":
        self.metrics.refused(reason)
        self.refusals.note(reason, message)
        return NoBackend(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def observe_admission(self, backend: Backend, decided: int, busy_ns: int) -> None:
        """``backend``'s statistics (``AdmissionWatcher``): its check finished ``decided`` requests so far."""
        now = time.monotonic()
        with self._lock:
            backend.admission.observe(decided, busy_ns, now)
            wait = backend.admission.predicted_wait_s()
            waiting = backend.admission.undecided > 0
        self.metrics.admission(backend.addr, wait)
        if waiting:  # (nothing in front of its check: nothing to expire)
            self.expire_admissions(backend, now)

    def admission_activity(self, now: float) -> tuple[list[Backend], list[Backend]]:
        """(backends with router edits not known to be past their admission check, the other backends that are
        refusing): the ones ``AdmissionWatcher`` polls at its fast pace. One look at every gauge under the lock."""
        waiting, refusing = [], []
        with self._lock:
            for b in self.backends.values():
                if b.admission.undecided > 0:
                    waiting.append(b)
                elif b.admission.refusing(now):
                    refusing.append(b)
        return waiting, refusing

    def admission_resumed(self) -> None:
        """The router was stopped (``AdmissionWatcher``'s stall): every gauge counts again from its next poll."""
        with self._lock:
            for b in self.backends.values():
                b.admission.resumed()

    def expire_admissions(self, backend: Backend, now: float | None = None) -> None:
        """Refuse, and cancel on ``backend``, the edits that have waited the admission wait in front of its check
        (by its latest counts: after every poll answer, and at every poll tick, so a slow answer does not delay
        them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = backend.admission.expire(now)
            age = None if backend.admission.observed_at is None else now - backend.admission.observed_at
        if not due:
            return
        refused = []
        for key, refuse in due:
            if refuse():
                refused.append(key)
            else:  # it had ended or streamed meanwhile: not the router's to refuse
                with self._lock:
                    backend.admission.unexpire(key)
        if refused:
            with self._lock:
                backend.admission.refused_for(now)
            for _ in refused:
                self.metrics.refused("admission_timeout")
            self.refusals.note("admission_timeout", f"{len(refused)} request(s) waited "
                               f"{backend.admission.wait_s:g} s in front of {backend.addr}'s admission check "
                               f"(its counts {age:.2f} s old)")
            threading.Thread(target=_cancel_on_backend, args=(backend, refused), daemon=True,
                             name="router-cancel").start()

    def answered(self, backend: Backend, rid: str, message: str = "") -> None:
        """``backend`` sent the final answer for ``rid`` (also for a request the router no longer waits for)."""
        with self._lock:
            e = backend.admission.entries.get(rid)
            late = e is not None and e.expired
            backend.admission.ended(rid, answered=True)
            if "RESOURCE_EXHAUSTED" in message:  # refused there (its denoise queue is full)
                backend.admission.backend_refused(time.monotonic())
        if late:  # refused by the router: what did the backend do with it?
            self.metrics.refused_late(backend.addr, _late_outcome(message))

    def release(self, t: Ticket, ok: bool, info: dict | None = None, temporal=None) -> None:
        """``t``'s request ended; ``info``: its EDIT_INFO when the estimator learns from it (temporal reuse)."""
        with self._lock:
            t.booking.remove(t.backend.load)
            if t.key is not None:
                t.backend.admission.ended(t.key, answered=False)
        observed = (time.monotonic() - t.t0) * 1000
        if ok:
            t.backend.succeeded()
            self.metrics.completed(t.backend.addr, self.policy.name, observed / 1000, t.booking.expected_ms / 1000)
            t.booking.observed(self.est, observed)
            if info and "temporal_computed_fraction" in info:
                self.est.observe_temporal(temporal, float(info["temporal_computed_fraction"]))
            self.metrics.model(self.est.scale, self.est.stale)

    def ModelInfer(self, request, context):
        tenant = getattr(context, "tenant", None) or ANONYMOUS
        try:
            self.quotas.enter(tenant)
        except OverLimit as e:
            self.tenant_refused(tenant, e)
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_s)
        t0, outcome, slot = time.monotonic(), "error", False
        stamp(request, time.time())  # received: the backends' bounds count from here (retries keep DEADLINE_MS)
        try:
            with self.metrics.features_s.time():
                f = routing_features(request, self.resolution)
            if self.fair is not None and f.runs_edit:
                why = self.fair.wait(tenant)
                if why is not None:
                    outcome = "refused"
                    self.metrics.tenant_refused(tenant.name, "fair_queue")
                    _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, why, 1.0)
                slot = True
            tag_request(request, tenant)  # the backends share their queues by it
            resp = self._model_infer(request, context, f)
            outcome = "ok"
            return resp
        finally:
            self.quotas.leave(tenant)
            if slot:
                self.fair.release()
            if outcome != "refused":
                self.metrics.tenant_ended(tenant.name, outcome, time.monotonic() - t0)

    def _model_infer(self, request, context, f):
        tried = set()
        remaining = context.time_remaining()
        deadline = time.monotonic() + min(self.retry_budget_s, remaining if remaining is not None else 1e9)
        attempt = 0
        refusal = None  # (backend, its RESOURCE_EXHAUSTED): tried on the others with room, else the caller's answer
        while True:
            try:
                t = self.route(f, exclude=tried, key=f"{self._prefix}-u{next(self._ids)}",
                               room_only=refusal is not None)
            except NoBackend as e:
                if refusal is not None:
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal[1])
                delay = None
                if e.code == grpc.StatusCode.UNAVAILABLE and context.is_active():
                    delay = self.backoff.next(attempt, deadline, time.monotonic())
                if delay is None:
                    context.abort(e.code, str(e) + (f" (retried {attempt} times)" if attempt else ""))
                attempt += 1
                time.sleep(delay)  # a worker held while it waits: a unary call in flight
                tried = set()  # after a wait, any backend back in rotation may take it
                continue
            if refusal is not None:
                self.metrics.retried(refusal[0], "refused")
            call = t.backend.stub.ModelInfer.future(request, timeout=_timeout(context, 600.0))
            context.add_callback(call.cancel)  # the client gave up: so does the backend call
            with self._lock:
                self._unary.add((t.backend, call))
            try:
                resp = call.result()
                t.backend.last_answer = time.monotonic()
                self.release(t, ok=True, info=edit_info(resp) if f.temporal is not None else None,
                             temporal=f.temporal)
                return resp
            except grpc.FutureCancelledError:  # the client went away, or the backend was found down
                self.release(t, ok=False)
                if not context.is_active():
                    context.abort(grpc.StatusCode.CANCELLED, "cancelled by the client")
                tried.add(t.backend.addr)
            except grpc.RpcError as e:
                self.release(t, ok=False)
                details = as_refusal(e.details() or "")  # Triton's own queue refusals read as refusals
                if "RESOURCE_EXHAUSTED" in details:  # its queue is full: alive, not a failure; try one with room
                    with self._lock:
                        t.backend.admission.backend_refused(time.monotonic())
                    refusal = (t.backend.addr, details)
                    tried.add(t.backend.addr)
                    continue
                fault = backend_fault(details)
                if e.code() != grpc.StatusCode.UNAVAILABLE and not fault:
                    context.abort(e.code(), details)
                # never reached a live model: try another backend
                if fault:
                    self.backend_broken(t.backend, details)
                else:
                    t.backend.failed()
                tried.add(t.backend.addr)
            finally:
                with self._lock:
                    self._unary.discard((t.backend, call))


def _late_outcome(message: str) -> str:
    """What a backend did with a request the router had refused on its behalf, from its final answer: ``dropped``
    (the cancel reached pre-processing first, as meant), ``refused_there`` (it reached the check before the cancel
    and was refused there: the router's refusal agreed), ``admitted`` (it passed the check: the cancel came late, or
    the router's count was wrong; the denoise loop drops it at its next step)."""
    if "cancelled before pre-processing" in message:
        return "dropped"
    if "RESOURCE_EXHAUSTED" in message:
        return "refused_there"
    return "admitted"


def _admission_summary(backends: list[Backend], now: float) -> str:
    parts = []
    for b in backends:
        v = b.admission.view(now)
        stalled = f", no progress for {v['stalled_s']:.1f} s" if v["stalled_s"] > b.admission.wait_s else ""
        parts.append(f"{b.addr} has {v['waiting']} waiting, ~{v['predicted_wait_s']:.2f} s{stalled}")
    return "; ".join(parts)


def _abort(context, code, details: str, retry_after_s: float):
    """Abort a call with a ``retry-after`` hint in its trailing metadata (where the context takes one)."""
    try:
        context.set_trailing_metadata((("retry-after", f"{retry_after_s:.3f}"),))
    except Exception:  # a context without trailing metadata (tests)
        pass
    context.abort(code, details)
