"""The router: a ``GRPCInferenceService`` server that forwards every call to one backend Triton and relays
every response back, so tritonclient and perf_analyzer work against it unchanged.

Streams: each client stream gets one stream per backend it uses; request ids are remapped to ids unique across
the router and mapped back on the way out (error texts included). The router asks backends for the empty final
response so it always knows when a request ended, and drops it again if the client did not ask for it.
Reliability: a request that has had no response yet is retried on another backend when its backend's stream
breaks, its backend is found unhealthy or answers that it cannot run requests (a dead stub); one that has streamed
responses is never replayed and ends with a clear error. Cancelling the client
stream cancels the backend streams and calls each backend's ``cancel`` model with the abandoned ids (Triton 2.51
does not forward a cancel into an ensemble step). Bounded in-flight per backend and overall, and admission
(``admission.py``): an edit goes only to a backend predicted to reach its admission check within the admission wait;
when none would, or every backend is at its in-flight limit, it is refused at once with RESOURCE_EXHAUSTED; a
streamed edit still waiting in front of a backend's check after the admission wait is refused by the router with
RESOURCE_EXHAUSTED and cancelled on the backend.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from maskedit_client.retry import Backoff, Timer

from .admission import AdmissionGauge, RefusalLog
from .auth import ANONYMOUS
from .features import EditFeatures, deadline_s, extract, grid_tokens, set_deadline_ms
from .metrics import RouterMetrics
from .policies import BackendLoad, Booking, Estimator, Policy
from .tenancy import OverLimit, Quotas, tag_request

log = logging.getLogger("maskedit.router")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
# Errors meaning the backend could not run the request at all: Triton 2.51 answers every request to a model whose
# Python stub died with this, while its health endpoints still say ready.
BACKEND_FAULT = re.compile(r"Stub process .* is not healthy")


def backend_fault(message: str) -> bool:
    return bool(BACKEND_FAULT.search(message or ""))


class Backend:
    """One Triton instance as the router sees it. It is in rotation when it is healthy (the health checker's
    latest verdict) and its circuit breaker is closed. The breaker opens on a definite fault (a dead stub answered,
    a health check failed) or after ``failure_threshold`` failures in a row (a broken stream, an UNAVAILABLE
    answer), and closes only
    when a real request succeeds on it (the health checker's probe request, once the backend says ready again):
    a restarted backend is not trusted because it answers readiness, only once it has served an edit."""

    def __init__(self, addr: str, failure_threshold: int = 3, admission: dict | None = None):
        self.addr = addr
        self.channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.load = BackendLoad(addr)
        self.failures, self.threshold = 0, failure_threshold
        self.circuit_open = False
        self.opened_at: float | None = None  # monotonic time the breaker last opened
        self.last_answer = 0.0  # monotonic time of its latest response (any: progress, result, error)
        self.admission = AdmissionGauge(**(admission or {}))  # its queue in front of its admission check

    def available(self, now: float | None = None) -> bool:
        return self.load.healthy and not self.circuit_open

    def failed(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_circuit()

    def trip(self) -> None:
        """A definite fault, not a timeout that may pass: out of rotation at once."""
        self.failures = max(self.failures, self.threshold)
        self.open_circuit()

    def open_circuit(self) -> None:
        if not self.circuit_open:
            self.circuit_open, self.opened_at = True, time.monotonic()
        self.load.forget()  # its caches are no longer trusted

    def succeeded(self) -> None:
        """A real request succeeded on it: the breaker closes."""
        self.failures = 0
        self.circuit_open = False

    def close(self) -> None:
        self.channel.close()


@dataclass
class Ticket:
    backend: Backend
    features: EditFeatures
    booking: Booking
    t0: float = field(default_factory=time.monotonic)
    key: str | None = None  # its entry in the backend's admission gauge (an edit the router sends itself)


class NoBackend(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Router(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, addrs: list[str], policy: Policy, estimator: Estimator, metrics: RouterMetrics | None = None,
                 max_inflight_per_backend: int = 32, max_inflight: int = 256, template_ttl_s: float = 300.0,
                 resolution: int = 1024, admission_wait_s: float = 0.6, retry_budget_s: float = 30.0):
        self.admission = {"wait_s": admission_wait_s}  # 0: no admission in the router, each backend decides alone
        self.store_capacity = (16, 64)  # template entries in a backend's memory and disk tiers (its store's shadow)
        self.backends = {a: self._backend(a) for a in addrs}
        self.resolution = resolution  # the served model's working resolution: masks are measured on its token grid
        self.policy, self.est = policy, estimator
        self.metrics = metrics or RouterMetrics()
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
        # who may send how much (tenancy.py): per-key limits, and the fair queue in front of the backends (None: off)
        self.quotas = Quotas()
        self.fair = None

    def tenant_refused(self, tenant, e: OverLimit) -> None:
        self.metrics.tenant_refused(tenant.name, e.reason)
        self.refusals.note(e.reason, f"tenant {tenant.name}: {e}")

    def backend_down(self, backend: "Backend", why: str) -> None:
        """``backend`` was found unhealthy while its streams may still be open (a stub that accepts requests and
        never answers): every stream request on it ends now, retried elsewhere if it had no response yet, else
        failed, exactly as if its stream had broken; its unary calls are retried elsewhere."""
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
            for a in [a for a in self.backends if a not in addrs]:
                self.backends.pop(a).close()

    def _backend(self, addr: str) -> Backend:
        b = Backend(addr, admission=self.admission)
        b.load.mem_templates, b.load.disk_templates = self.store_capacity
        return b

    def available(self, exclude=()) -> list[Backend]:
        now = time.monotonic()
        with self._lock:
            return [b for b in self.backends.values() if b.available(now) and b.addr not in exclude]

    # -- routing and accounting ---------------------------------------------------------------------
    def route(self, f: EditFeatures, exclude=(), key: str | None = None, on_expire=None) -> Ticket:
        """A backend for ``f``. ``key`` (a request id unique in the router) enters an edit the router sends itself
        in the chosen backend's admission gauge; ``on_expire`` refuses it on its stream (returns whether it did)
        if it waits too long in front of the backend's check."""
        t0 = time.perf_counter()
        cands = self.available(exclude)
        if not cands:
            raise NoBackend(grpc.StatusCode.UNAVAILABLE, "no healthy backend")
        now = time.monotonic()
        with self._lock:
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
        self.metrics.admission(backend.addr, wait)
        self.expire_admissions(backend, now)

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

    def release(self, t: Ticket, ok: bool) -> None:
        with self._lock:
            t.booking.remove(t.backend.load)
            if t.key is not None:
                t.backend.admission.ended(t.key, answered=False)
        observed = (time.monotonic() - t.t0) * 1000
        if ok:
            t.backend.succeeded()
            self.metrics.completed(t.backend.addr, self.policy.name, observed / 1000, t.booking.expected_ms / 1000)
            t.booking.observed(self.est, observed)
            self.metrics.model(self.est.scale, self.est.stale)

    # -- plain calls: forwarded to a healthy backend ------------------------------------------------
    def _forward(self, method: str, request, context):
        last = None
        for b in self.available() or list(self.backends.values()):
            try:
                return getattr(b.stub, method)(request, timeout=_timeout(context, 30.0))
            except grpc.RpcError as e:
                last = e
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    context.abort(e.code(), e.details())
                b.failed()
        context.abort(grpc.StatusCode.UNAVAILABLE, f"no backend answered {method}: {last}")

    def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=bool(self.available()))

    def ModelReady(self, request, context):
        return self._forward("ModelReady", request, context)

    def ServerMetadata(self, request, context):
        return self._forward("ServerMetadata", request, context)

    def ModelMetadata(self, request, context):
        return self._forward("ModelMetadata", request, context)

    def ModelConfig(self, request, context):
        return self._forward("ModelConfig", request, context)

    def ModelStatistics(self, request, context):
        """Summed over every backend, so perf_analyzer's server-side view matches the traffic it sent."""
        merged, by_key = None, {}
        for b in self.available():
            try:
                resp = b.stub.ModelStatistics(request, timeout=_timeout(context, 10.0))
            except grpc.RpcError:
                continue
            if merged is None:
                merged = resp
                by_key = {(m.name, m.version): m for m in merged.model_stats}
                continue
            for m in resp.model_stats:
                if (m.name, m.version) in by_key:
                    _add_stats(by_key[(m.name, m.version)], m)
                else:
                    merged.model_stats.add().CopyFrom(m)
        if merged is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no backend answered ModelStatistics")
        return merged

    def RepositoryIndex(self, request, context):
        return self._forward("RepositoryIndex", request, context)

    def RepositoryModelLoad(self, request, context):
        """Admin only (the transport checks the role): load a model on every backend (Triton answers its own error
        unless it runs with explicit model control)."""
        return self._forward_all("RepositoryModelLoad", request, context)

    def RepositoryModelUnload(self, request, context):
        return self._forward_all("RepositoryModelUnload", request, context)

    def _forward_all(self, method: str, request, context):
        """``method`` on every backend (the served set is the same everywhere); the first error is the answer."""
        resp = None
        for b in list(self.backends.values()):
            try:
                resp = getattr(b.stub, method)(request, timeout=_timeout(context, 120.0))
            except grpc.RpcError as e:
                context.abort(e.code(), f"{b.addr}: {e.details()}")
        if resp is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no backend")
        return resp

    def ModelInfer(self, request, context):
        tenant = getattr(context, "tenant", None) or ANONYMOUS
        try:
            self.quotas.enter(tenant)
        except OverLimit as e:
            self.tenant_refused(tenant, e)
            _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_s)
        t0, outcome, slot = time.monotonic(), "error", False
        try:
            f = _features(request, self.resolution)
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
        while True:
            try:
                t = self.route(f, exclude=tried, key=f"{self._prefix}-u{next(self._ids)}")
            except NoBackend as e:
                delay = None
                if e.code == grpc.StatusCode.UNAVAILABLE and context.is_active():
                    delay = self.backoff.next(attempt, deadline, time.monotonic())
                if delay is None:
                    context.abort(e.code, str(e) + (f" (retried {attempt} times)" if attempt else ""))
                attempt += 1
                time.sleep(delay)  # a worker held while it waits: a unary call in flight
                tried = set()  # after a wait, any backend back in rotation may take it
                continue
            call = t.backend.stub.ModelInfer.future(request, timeout=_timeout(context, 600.0))
            context.add_callback(call.cancel)  # the client gave up: so does the backend call
            with self._lock:
                self._unary.add((t.backend, call))
            try:
                resp = call.result()
                t.backend.last_answer = time.monotonic()
                self.release(t, ok=True)
                return resp
            except grpc.FutureCancelledError:  # the client went away, or the backend was found down
                self.release(t, ok=False)
                if not context.is_active():
                    context.abort(grpc.StatusCode.CANCELLED, "cancelled by the client")
                tried.add(t.backend.addr)
            except grpc.RpcError as e:
                self.release(t, ok=False)
                if "RESOURCE_EXHAUSTED" in (e.details() or ""):
                    with self._lock:
                        t.backend.admission.backend_refused(time.monotonic())
                fault = backend_fault(e.details())
                if e.code() != grpc.StatusCode.UNAVAILABLE and not fault:
                    context.abort(e.code(), e.details())
                # never reached a live model: try another backend
                if fault:
                    self.backend_broken(t.backend, e.details())
                else:
                    t.backend.failed()
                tried.add(t.backend.addr)
            finally:
                with self._lock:
                    self._unary.discard((t.backend, call))

    # -- streams ------------------------------------------------------------------------------------
    def ModelStreamInfer(self, request_iterator, context):
        session = _StreamSession(self, context)
        reader = threading.Thread(target=session.read, args=(request_iterator,), daemon=True, name="router-read")
        reader.start()
        while True:
            item = session.out.get()
            if item is None:
                break
            yield item
        session.close()


@dataclass
class _Pending:
    client_id: str
    request: object  # the forwarded ModelInferRequest (kept for a retry)
    ticket: Ticket
    want_final: bool
    responded: bool = False
    tenant: object = ANONYMOUS
    t0: float = 0.0
    slot: bool = False  # holds a slot of the router's fair queue
    ended: bool = False
    tried: set = field(default_factory=set)  # backends that failed it before any response (not retried there)
    deadline: float = 0.0  # monotonic: retried when no backend is up until then
    attempt: int = 0


class _StreamSession:
    """One client stream: its backend streams, its in-flight requests, its output queue."""

    def __init__(self, router: Router, context, out=None):
        self.r, self.context = router, context
        self.out = queue.Queue() if out is None else out  # anything with put(): the transport relays from it
        self.pending: dict[str, _Pending] = {}
        self.streams: dict[str, _BackendStream] = {}
        self.lock = threading.Lock()
        self.reading = True
        self.retrying = 0  # requests waiting out a backoff (or in the fair queue) before being routed again
        self.tenant = getattr(context, "tenant", None) or ANONYMOUS
        context.add_callback(self.on_client_gone)
        router._sessions.add(self)

    def read(self, request_iterator) -> None:
        try:
            for req in request_iterator:
                self.submit(req)
        except Exception as e:  # the client went away mid-read
            log.info("client stream ended: %s", e)
        finally:
            self.reading = False
            self._maybe_finish()

    def submit(self, req, exclude=()) -> None:
        client_id = req.id
        rid = f"{self.r._prefix}-{next(self.r._ids)}"
        fwd = service_pb2.ModelInferRequest()
        fwd.CopyFrom(req)
        fwd.id = rid
        want_final = bool(req.parameters[EMPTY_FINAL].bool_param) if EMPTY_FINAL in req.parameters else False
        fwd.parameters[EMPTY_FINAL].bool_param = True
        tag_request(fwd, self.tenant)  # the backends share their queues by it
        own = deadline_s(req)
        try:
            self.r.quotas.enter(self.tenant)
        except OverLimit as e:  # over its key's limits: refused at once
            self.r.tenant_refused(self.tenant, e)
            self.out.put(_error(client_id, str(e)))
            return
        p = _Pending(client_id, fwd, None, want_final, tenant=self.tenant, t0=time.monotonic(),
                     deadline=time.monotonic() + (self.r.retry_budget_s if own is None else own))
        f = _features(req, self.r.resolution)
        if self.r.fair is not None and f.runs_edit:
            with self.lock:
                self.retrying += 1  # waits in the fair queue: the stream is busy

            def granted():
                with self.lock:
                    self.retrying -= 1
                p.slot = True
                if not self.context.is_active():  # the client went away while it waited
                    self._end(p, "cancelled")
                    self._maybe_finish()
                    return
                self._send(p, rid, f, exclude)

            def refused(message: str):
                with self.lock:
                    self.retrying -= 1
                self.r.metrics.tenant_refused(self.tenant.name, "fair_queue")
                self.r.metrics.refused("fair_queue")
                self._end(p, None)
                self.out.put(_error(client_id, message))
                self._maybe_finish()

            self.r.fair.request(self.tenant, granted, refused)
            return
        self._send(p, rid, f, exclude)

    def _end(self, p: _Pending, outcome: str | None) -> None:
        """``p`` is over for its client (answered, failed, refused or abandoned): its tenant's books close, once.
        ``outcome`` None: already counted (a refusal)."""
        with self.lock:
            if p.ended:
                return
            p.ended = True
        self.r.quotas.leave(p.tenant)
        if p.slot:
            p.slot = False
            self.r.fair.release()
        if outcome is not None:
            self.r.metrics.tenant_ended(p.tenant.name, outcome, time.monotonic() - p.t0)

    def _send(self, p: _Pending, rid: str, f: EditFeatures, exclude) -> None:
        try:
            p.ticket = self.r.route(f, exclude=exclude, key=rid, on_expire=lambda: self.expire(rid))
        except NoBackend as e:
            if e.code == grpc.StatusCode.UNAVAILABLE and self._retry_later(p, rid, f):
                return
            retried = f" (retried {p.attempt} times)" if p.attempt else ""
            self._end(p, "refused" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "error")
            self.out.put(_error(p.client_id, f"{e.code.name}: {e}{retried}"))
            self._maybe_finish()
            return
        with self.lock:
            self.pending[rid] = p
            bs = self.streams.get(p.ticket.backend.addr)
            if bs is None or bs.broken:
                bs = self.streams[p.ticket.backend.addr] = _BackendStream(self, p.ticket.backend)
        bs.send(p.request)

    def _retry_later(self, p: _Pending, rid: str, f: EditFeatures) -> bool:
        """No backend can take ``p`` now: route it again after a backoff, if it has streamed nothing and its
        deadline leaves time (``maskedit_client.retry``: the client's rule)."""
        if p.responded or not self.context.is_active():
            return False
        delay = self.r.backoff.next(p.attempt, p.deadline, time.monotonic())
        if delay is None:
            return False
        p.attempt += 1
        with self.lock:
            self.retrying += 1
        self.r.timer.call_later(delay, lambda: self._retry(p, rid, f))
        return True

    def _retry(self, p: _Pending, rid: str, f: EditFeatures) -> None:
        with self.lock:
            self.retrying -= 1
        if not self.context.is_active():  # the client went away meanwhile
            self._end(p, "cancelled")
            self._maybe_finish()
            return
        if deadline_s(p.request) is not None:  # what is left of its own deadline
            set_deadline_ms(p.request, max(1, int((p.deadline - time.monotonic()) * 1000)))
        self.r.metrics.retried("none")
        self._send(p, rid, f, exclude=())  # after a wait, any backend back in rotation may take it

    def on_response(self, backend: Backend, resp) -> None:
        rid = resp.infer_response.id
        if not rid and resp.error_message:
            m = re.search(r"request id: ([\w-]+)", resp.error_message)
            rid = m.group(1) if m else ""
        if backend_fault(resp.error_message):
            self.on_fault(backend, rid, resp.error_message)
            return
        final = FINAL in resp.infer_response.parameters and resp.infer_response.parameters[FINAL].bool_param
        error = bool(resp.error_message)
        if final or error:
            self.r.answered(backend, rid, resp.error_message)  # done with it (also one the router refused meanwhile)
        with self.lock:  # taken off at once when it ends: the router's admission timeout may not refuse it too
            p = self.pending.pop(rid, None) if final or error else self.pending.get(rid)
            if p is not None and not (final or error):
                p.responded = True  # a progress response, relayed below
        backend.last_answer = time.monotonic()  # it answers: alive, whatever this response is
        if p is None:
            return
        resp.infer_response.id = p.client_id
        if error:
            resp.error_message = _with_request_id(resp.error_message.replace(rid, p.client_id), p.client_id)
        empty_final = final and not resp.infer_response.outputs and not error
        if not empty_final or p.want_final:
            self.out.put(resp)
            p.responded = True
        if final or error:
            self.r.release(p.ticket, ok=not error)
            self._end(p, "error" if error else "ok")
            self._retire(backend)
            self._maybe_finish()

    def _retire(self, backend: Backend) -> None:
        """Close this session's stream to ``backend`` once nothing of it is in flight there: an idle client stream
        then holds no backend stream and none of its threads (the next request opens a new one)."""
        with self.lock:  # _send adds to pending and picks the stream under this lock: never a stream it is using
            if any(q.ticket.backend is backend for q in self.pending.values()):
                return
            bs = self.streams.pop(backend.addr, None)
        if bs is not None:
            bs.close()

    def expire(self, rid: str) -> bool:
        """The router's admission timeout: ``rid`` has waited too long in front of its backend's admission check.
        Refused on the client's stream now, unless it has ended or streamed meanwhile (then past the check)."""
        with self.lock:
            p = self.pending.get(rid)
            if p is None or p.responded:
                return False
            del self.pending[rid]
        self.r.release(p.ticket, ok=False)
        self._end(p, "refused")
        waited = time.monotonic() - p.ticket.t0
        self.out.put(_error(p.client_id, f"RESOURCE_EXHAUSTED: waited {waited:.2f} s in front of backend "
                                         f"{p.ticket.backend.addr}'s admission check; refused by the router, retry "
                                         "later"))
        self._maybe_finish()
        return True

    def on_fault(self, backend: Backend, rid: str, message: str) -> None:
        """The backend answered that it cannot run requests (its stub died): out of rotation now, its other
        requests end as if its stream broke (those inside the dead stub would never be answered), and this one is
        retried elsewhere if the client has had nothing from it yet."""
        with self.lock:
            p = self.pending.pop(rid, None)
        self.r.backend_broken(backend, message)
        if p is not None:
            self._lost(p, rid, backend, message)
        self._maybe_finish()

    def _lost(self, p: _Pending, rid: str, backend: Backend, why) -> None:
        """``backend`` will not finish ``p``: retried on another backend if the client has had nothing from it,
        else failed (never replayed)."""
        self.r.release(p.ticket, ok=False)
        if p.responded or not self.context.is_active():
            self._end(p, "error")
            self.out.put(_error(p.client_id, f"UNAVAILABLE: backend {backend.addr} failed after this request had "
                                             f"streamed responses; it is not replayed ({why})"))
            return
        self.r.metrics.retried(backend.addr)
        p.tried.add(backend.addr)
        self._send(p, rid, p.ticket.features, exclude=p.tried)

    def on_broken(self, backend: Backend, exc) -> None:
        """The backend's stream failed: retry what never answered, fail what did (never replayed)."""
        backend.failed()
        with self.lock:
            lost = [(rid, p) for rid, p in self.pending.items() if p.ticket.backend is backend]
            for rid, _ in lost:
                self.pending.pop(rid)
        for rid, p in lost:
            self._lost(p, rid, backend, exc)
        self._maybe_finish()

    def abandon(self, backend: Backend, why: str) -> None:
        """Stop waiting for ``backend`` (declared unhealthy): drop its stream, then handle its requests as lost."""
        with self.lock:
            bs = self.streams.get(backend.addr)
            if bs is None or not any(p.ticket.backend is backend for p in self.pending.values()):
                return
            bs.broken = True  # later sends open a new stream
        bs.cancel()
        self.on_broken(backend, why)

    def on_client_gone(self) -> None:
        with self.lock:
            abandoned = list(self.pending.items())
            self.pending.clear()
        by_backend: dict[Backend, list[str]] = {}
        for rid, p in abandoned:
            by_backend.setdefault(p.ticket.backend, []).append(rid)
            self.r.release(p.ticket, ok=False)
            self._end(p, "cancelled")
        for backend, ids in by_backend.items():
            _cancel_on_backend(backend, ids)
        for bs in list(self.streams.values()):
            bs.cancel()
        self.out.put(None)

    def busy(self) -> bool:
        """Something is in flight on it (not idle)."""
        return bool(self.pending) or self.retrying > 0

    def _maybe_finish(self) -> None:
        with self.lock:
            done = not self.reading and not self.pending and not self.retrying
        if done:
            self.out.put(None)

    def close(self) -> None:
        for bs in list(self.streams.values()):
            bs.close()


class _BackendStream:
    def __init__(self, session: _StreamSession, backend: Backend):
        self.session, self.backend = session, backend
        self.q: queue.Queue = queue.Queue()
        self.broken = self.closed = False
        self.call = backend.stub.ModelStreamInfer(self._requests())
        threading.Thread(target=self._consume, daemon=True, name=f"router-{backend.addr}").start()

    def _requests(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item

    def send(self, req) -> None:
        self.q.put(req)

    def _consume(self) -> None:
        try:
            for resp in self.call:
                try:
                    self.session.on_response(self.backend, resp)
                except Exception:  # one bad response must not stop the stream's other requests
                    log.exception("could not relay a response from %s", self.backend.addr)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED and not self.closed:  # closed: nothing of ours was on it
                self.broken = True
                self.session.on_broken(self.backend, e.code().name)

    def cancel(self) -> None:
        self.q.put(None)
        self.call.cancel()

    def close(self) -> None:
        self.closed = True
        self.q.put(None)


def _cancel_on_backend(backend: Backend, ids: list[str]) -> None:
    try:
        req = service_pb2.ModelInferRequest(model_name="cancel")
        t = req.inputs.add()
        t.name, t.datatype = "REQUEST_IDS", "BYTES"
        t.shape.append(len(ids))
        t.contents.bytes_contents.extend([i.encode() for i in ids])
        backend.stub.ModelInfer(req, timeout=5)
    except grpc.RpcError as e:
        log.info("cancel on %s failed: %s", backend.addr, e.code().name)


def _add_stats(dst, src) -> None:
    """dst += src over every counter of a statistics message (max for timestamps)."""
    for fd, val in src.ListFields():
        if fd.type == fd.TYPE_MESSAGE:
            if fd.label == fd.LABEL_REPEATED:
                target = getattr(dst, fd.name)
                if fd.message_type.GetOptions().map_entry:
                    for k, v in val.items():
                        _add_stats(target[k], v)
                else:
                    for i, item in enumerate(val):
                        if i < len(target):
                            _add_stats(target[i], item)
                        else:
                            target.add().CopyFrom(item)
            else:
                _add_stats(getattr(dst, fd.name), val)
        elif fd.label != fd.LABEL_REPEATED and isinstance(val, int) and fd.name != "batch_size":
            cur = getattr(dst, fd.name)
            setattr(dst, fd.name, max(cur, val) if fd.name.startswith("last_") else cur + val)


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


def _features(req, resolution: int) -> EditFeatures:
    if req.model_name != "edit":
        return EditFeatures(None, 0.0, 0, None)
    try:
        return extract(req, resolution)
    except Exception:
        return EditFeatures(None, 1.0, grid_tokens(resolution), None)


def _with_request_id(message: str, client_id: str) -> str:
    """The error text naming the client's request id. tritonclient's stream callback hands a client only the
    error text (the response's id field is dropped), so a client with several requests pending on one stream can
    match an error to its request only by this."""
    if not client_id or f"request id: {client_id}" in message:
        return message
    return f"{message} [request id: {client_id}]"


def _abort(context, code, details: str, retry_after_s: float):
    """Abort a call with a ``retry-after`` hint in its trailing metadata (where the context takes one)."""
    try:
        context.set_trailing_metadata((("retry-after", f"{retry_after_s:.3f}"),))
    except Exception:  # a context without trailing metadata (tests)
        pass
    context.abort(code, details)


def _error(client_id: str, message: str):
    resp = service_pb2.ModelStreamInferResponse(error_message=_with_request_id(message, client_id))
    resp.infer_response.id = client_id
    resp.infer_response.parameters[FINAL].bool_param = True
    return resp


def _timeout(context, default: float) -> float:
    remaining = context.time_remaining()
    return default if remaining is None else max(0.1, min(default, remaining))


def probe_edit_request() -> object:
    """A real request through every stage that does no model work (empty mask): used as a health probe."""
    from maskedit_client import encode_image

    req = service_pb2.ModelInferRequest(model_name="edit", id="health-probe")
    for name, value in (("TEMPLATE", encode_image(np.full((16, 16, 3), 128, np.uint8))),
                        ("MASK", encode_image(np.zeros((16, 16), np.uint8))),
                        ("PROMPT", b"health probe")):
        t = req.inputs.add()
        t.name, t.datatype = name, "BYTES"
        t.shape.append(1)
        t.contents.bytes_contents.append(value)
    req.parameters[EMPTY_FINAL].bool_param = True
    return req
