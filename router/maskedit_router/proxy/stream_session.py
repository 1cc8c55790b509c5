"""One client stream through the router: its requests are forwarded on the router's one stream per backend, shared
by every client stream (``backend_streams.BackendStreams``), their ids remapped to router-unique ids and mapped back
(error texts too); a request with no response yet is retried elsewhere when its backend fails, one that has streamed
is never replayed; the client going away cancels its requests on their backends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from tritonclient.grpc import service_pb2

from maskedit_common.request_id import tagged
from maskedit_common.triton_refusals import as_refusal

from ..access.auth import ANONYMOUS
from ..access.tenancy import OverLimit, tag_request
from ..placement.features import EditFeatures, deadline_s, edit_info, routing_features, set_deadline_ms
from .backend import EMPTY_FINAL, FINAL, Backend, NoBackend, Ticket, _cancel_on_backend, backend_fault
from .backend_streams import is_final, response_id
from .stamp import stamp

if TYPE_CHECKING:
    from .server import Router

log = logging.getLogger("maskedit.router")
REFUSED = "RESOURCE_EXHAUSTED"  # a backend's refusal at its admission check (the Python backend sends it as text)


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
    temporal: object = None  # its TEMPORAL policy: the estimator learns its computed fraction from its EDIT_INFO


@dataclass
class _Held:
    """What relaying one response had done when it failed: the request it had taken off the pending set, and
    whether its ticket was released."""

    p: _Pending | None = None
    released: bool = False
    relayed: bool = False  # its client has its final answer already: the books are closed, no second answer


class _StreamSession:
    """One client stream: its in-flight requests, its output queue."""

    def __init__(self, router: Router, context, out=None):
        self.r, self.context = router, context
        self.out = queue.Queue() if out is None else out  # anything with put(): the transport relays from it
        self.pending: dict[str, _Pending] = {}
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
        """Route and forward ``req``, a request read from the client's stream. It is forwarded itself, not a copy (a
        512² edit is ~0.4 MB): nothing else holds it, and only its id and parameters change, after the client's id
        and EMPTY_FINAL are read; what is read of it later (DEADLINE_MS, the inputs) is never changed here."""
        client_id = req.id
        rid = f"{self.r._prefix}-{next(self.r._ids)}"
        want_final = bool(req.parameters[EMPTY_FINAL].bool_param) if EMPTY_FINAL in req.parameters else False
        fwd = req
        fwd.id = rid
        fwd.parameters[EMPTY_FINAL].bool_param = True
        tag_request(fwd, self.tenant)  # the backends share their queues by it
        stamp(fwd, time.time())  # their bounds count from here
        own = deadline_s(req)
        try:
            self.r.quotas.enter(self.tenant)
        except OverLimit as e:  # over its key's limits: refused at once
            self.r.tenant_refused(self.tenant, e)
            self.out.put(_error(client_id, str(e)))
            return
        p = _Pending(client_id, fwd, None, want_final, tenant=self.tenant, t0=time.monotonic(),
                     deadline=time.monotonic() + (self.r.retry_budget_s if own is None else own))
        with self.r.metrics.features_s.time():
            f = routing_features(req, self.r.resolution)
        p.temporal = f.temporal
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
            self._place(p, rid, f, exclude)
        except NoBackend as e:
            if e.code == grpc.StatusCode.UNAVAILABLE and self._retry_later(p, rid, f):
                return
            retried = f" (retried {p.attempt} times)" if p.attempt else ""
            self._end(p, "refused" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "error")
            self.out.put(_error(p.client_id, f"{e.code.name}: {e}{retried}"))
            self._maybe_finish()

    def _place(self, p: _Pending, rid: str, f: EditFeatures, exclude, room_only: bool = False) -> None:
        """Route ``p`` and send it on this session's stream to its backend (raises ``NoBackend``)."""
        p.ticket = self.r.route(f, exclude=exclude, key=rid, on_expire=lambda: self.expire(rid), room_only=room_only)
        backend = p.ticket.backend
        with self.lock:
            self.pending[rid] = p  # (before the send: its answer may come at once)
        try:
            self.r.backend_streams.send(self, backend, p.request)
        except Exception as e:  # its channel closed (just removed from the set), no thread to be had
            with self.lock:
                if self.pending.get(rid) is p:
                    del self.pending[rid]
            # as if no backend were up: retried later or answered now (``_send``), never left pending
            self.r.release(p.ticket, ok=False)
            raise NoBackend(grpc.StatusCode.UNAVAILABLE, f"cannot open a stream to backend {backend.addr}: {e}") from e

    def _elsewhere(self, p: _Pending, rid: str, backend: Backend, why: str = "refused") -> bool:
        """``backend`` refused ``p`` (RESOURCE_EXHAUSTED: its queue is full) before anything of it reached the
        client: send it to another backend with room (``Router.route``'s ``room_only``). After a router restart or
        stall the clients' retried burst meets one backend's full queue while another has room; refusing it then
        turned away work with capacity free. False when no other backend has room (every one is full or refusing, or
        refused it already): the client gets the refusal."""
        if not self.context.is_active():
            return False
        p.tried.add(backend.addr)
        try:
            self._place(p, rid, p.ticket.features, p.tried, room_only=True)
        except NoBackend:
            return False
        self.r.metrics.retried(backend.addr, why)
        return True

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
        if deadline_s(p.request) is not None:  # what is left of its own deadline, counted from now
            set_deadline_ms(p.request, max(1, int((p.deadline - time.monotonic()) * 1000)))
            stamp(p.request, time.time())
        self.r.metrics.retried("none")
        self._send(p, rid, f, exclude=())  # after a wait, any backend back in rotation may take it

    def on_response(self, backend: Backend, resp) -> None:
        """Relay one backend response. Should relaying it fail (a bug, a response the router cannot read), its
        request is answered with an error naming the router, not left waiting (``_relay_failed``)."""
        held = _Held()
        try:
            self._on_response(backend, resp, held)
        except Exception:
            self._relay_failed(backend, resp, held)
            raise

    def _relay_failed(self, backend: Backend, resp, held: "_Held") -> None:
        """``resp`` could not be relayed: its request (already taken off the pending set, or still on it for this
        backend) ends with an INTERNAL error; never retried, as the backend may have run it."""
        p = held.p
        with self.lock:
            if p is None:
                rid = resp.infer_response.id
                p = self._waiting_on(backend, rid, take=True) if rid else None
            elif any(q is p for q in self.pending.values()):  # it was sent to another backend: that one answers
                return
        if p is None or p.ended:
            return
        try:
            if not held.released:
                self.r.release(p.ticket, ok=False)
        finally:
            if not held.relayed:
                self.out.put(_error(p.client_id, "INTERNAL: the router could not relay the backend's response"))
            self._end(p, "error")
            self._maybe_finish()

    def _on_response(self, backend: Backend, resp, held: "_Held") -> None:
        if resp.error_message:  # Triton's own queue refusals read as the refusals they are
            resp.error_message = as_refusal(resp.error_message)
        rid = response_id(resp)
        if backend_fault(resp.error_message):
            self.on_fault(backend, rid, resp.error_message)
            return
        final = is_final(resp)
        error = bool(resp.error_message)
        if final or error:
            self.r.answered(backend, rid, resp.error_message)  # done with it (also one the router refused meanwhile)
        with self.lock:  # taken off at once when it ends: the router's admission timeout may not refuse it too
            p = self._waiting_on(backend, rid, take=final or error)
            if p is not None and not (final or error):
                p.responded = True  # a progress response, relayed below
        backend.last_answer = time.monotonic()  # it answers: alive, whatever this response is
        if p is None:
            return
        held.p = p if (final or error) else None  # a progress response's request stays pending: found there
        released = False
        if error and not p.responded and REFUSED in resp.error_message:
            self.r.release(p.ticket, ok=False)
            released = held.released = True
            if self._elsewhere(p, rid, backend):  # its refusal is not relayed: another backend has it now
                return
        resp.infer_response.id = p.client_id
        if error:
            resp.error_message = tagged(resp.error_message.replace(rid, p.client_id), p.client_id)
        empty_final = final and not resp.infer_response.outputs and not error
        if not empty_final or p.want_final:
            self.out.put(resp)
            p.responded = True
            held.relayed = final or error
        if final or error:
            if not released:
                info = edit_info(resp.infer_response) if p.temporal is not None and not error else None
                held.released = True  # once: a failure inside release must not release it again
                self.r.release(p.ticket, ok=not error, info=info, temporal=p.temporal)
            self._end(p, "error" if error else "ok")
            self._maybe_finish()

    def _waiting_on(self, backend: Backend, rid: str, take: bool) -> _Pending | None:
        """``rid``'s request if it is waiting on ``backend`` (taken off the pending set with ``take``); None for an
        answer from a backend it was moved away from (left waiting there, sent to another: the first one's answer,
        "cancelled", a refusal or a late result, is not its client's). Under ``self.lock``."""
        p = self.pending.get(rid)
        if p is None or p.ticket.backend is not backend:
            return None
        if take:
            del self.pending[rid]
        return p

    def expire(self, rid: str) -> bool:
        """The router's admission timeout: ``rid`` has waited too long in front of its backend's admission check
        (while that backend refuses). Moved to a backend with room if one has (the first drops it: cancelled), else
        refused on the client's stream now; nothing, if it has ended or streamed meanwhile (then past the check)."""
        with self.lock:
            p = self.pending.get(rid)
            if p is None or p.responded:
                return False
            del self.pending[rid]
        self.r.release(p.ticket, ok=False)
        if self._elsewhere(p, rid, p.ticket.backend, why="waited"):
            return True
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
            p = self._waiting_on(backend, rid, take=True)
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
        self.lose(backend, exc)

    def lose(self, backend: Backend, exc, rids=None) -> None:
        """This session's requests on ``backend`` (of them, ``rids``: those on a stream that broke, not one opened
        since) end there: retried or failed (``_lost``)."""
        with self.lock:
            lost = [(rid, p) for rid, p in self.pending.items()
                    if p.ticket.backend is backend and (rids is None or rid in rids)]
            for rid, _ in lost:
                self.pending.pop(rid)
        for rid, p in lost:
            self._lost(p, rid, backend, exc)
        self._maybe_finish()

    def abandon(self, backend: Backend, why: str) -> None:
        """Stop waiting for ``backend`` (declared unhealthy; ``Router.backend_down`` has dropped its stream): handle
        this session's requests there as lost."""
        with self.lock:
            if not any(p.ticket.backend is backend for p in self.pending.values()):
                return
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
            self.r.backend_streams.forget(backend, ids)  # their answers (the cancel's) are no one's now
            _cancel_on_backend(backend, ids)
        self.out.put(None)

    def busy(self) -> bool:
        """Something is in flight on it (not idle)."""
        return bool(self.pending) or self.retrying > 0

    def _maybe_finish(self) -> None:
        with self.lock:
            done = not self.reading and not self.pending and not self.retrying
        if done:
            self.out.put(None)


def _error(client_id: str, message: str):
    resp = service_pb2.ModelStreamInferResponse(error_message=tagged(message, client_id))
    resp.infer_response.id = client_id
    resp.infer_response.parameters[FINAL].bool_param = True
    return resp
