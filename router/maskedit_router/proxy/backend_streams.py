"""The router's streams to its backends: one per backend, shared by every client stream (``stream_session``).

A stream opened per request cost 1.69 ms of router CPU (a new HTTP/2 stream, gRPC's request-consuming thread, the
router's reader thread) against 0.53 ms on a reused one (``make router-cpu``, quiet host): a backend's stream is opened once,
kept while it carries requests and closed after ``idle_s`` with none.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc

from maskedit_common.request_id import named

from .backend import FINAL, Backend, backend_fault

log = logging.getLogger("maskedit.router")


class BackendStreams:
    """The router's streams to its backends: one per backend, shared by every client stream, each response handed to
    the session whose request it answers (by the router-unique id it was forwarded with; the entry goes with the
    request's final answer or error, or when its client goes away). A stream that breaks hands each session with a
    request on it ``lose`` once (the backend counts one failure); ``drop`` (the backend is given up) cancels it and
    leaves its requests to ``_StreamSession.abandon``; a stream that has carried nothing for ``idle_s`` is closed
    (0: as soon as nothing is on it, as a stream per request did)."""

    def __init__(self, router, idle_s: float = 30.0):
        self.r, self.idle_s = router, idle_s
        self.lock = threading.Lock()
        self.open: dict[str, _Shared] = {}

    def send(self, session, backend: Backend, req) -> None:
        """Forward ``req`` (its id router-unique) for ``session`` on ``backend``'s stream, opened if there is none
        (raises if it cannot be: the caller answers the request)."""
        with self.lock:  # a stream found here is not closed for idling before the request is on it (``_idle``)
            bs = self.open.get(backend.addr)
            if bs is None or bs.broken:
                bs = _Shared(self, backend)
                bs.stream = _BackendStream(bs, backend)
                self.open[backend.addr] = bs
                self.r.metrics.backend_stream(backend.addr, "opened")
            bs.owners[req.id] = session
            bs.stream.send(req)

    def dispatch(self, bs: "_Shared", resp) -> None:
        """``resp`` came on ``bs``: relay it through its request's session. A fault answer no session owns (no
        request id) still takes the backend out of rotation."""
        rid = response_id(resp)
        with self.lock:
            session = bs.owners.get(rid)
            if session is not None and (is_final(resp) or resp.error_message):
                del bs.owners[rid]
                self._idle(bs)
        if session is not None:
            session.on_response(bs.backend, resp)
        elif backend_fault(resp.error_message):
            self.r.backend_broken(bs.backend, resp.error_message)

    def broken(self, bs: "_Shared", why: str) -> None:
        """``bs`` ended without the router asking: one failure of its backend, and each session with requests on it
        retries or fails them (``_StreamSession.lose``)."""
        with self.lock:
            bs.broken = True
            if self.open.get(bs.backend.addr) is bs:
                del self.open[bs.backend.addr]
            by_session: dict[int, tuple[object, set]] = {}
            for rid, s in bs.owners.items():
                by_session.setdefault(id(s), (s, set()))[1].add(rid)
            bs.owners.clear()
        self.r.metrics.backend_stream(bs.backend.addr, "broken")
        bs.backend.failed()
        for session, rids in by_session.values():
            try:
                session.lose(bs.backend, why, rids)
            except Exception:  # one session's failure must not leave the others' requests waiting
                log.exception("could not end the requests on a broken stream to %s", bs.backend.addr)

    def drop(self, backend: Backend) -> None:
        """``backend`` is given up: cancel its stream (its sessions' ``abandon`` ends their requests there)."""
        with self.lock:
            bs = self.open.pop(backend.addr, None)
            if bs is not None:
                bs.broken = True
                bs.owners.clear()
        if bs is not None:
            bs.stream.cancel()

    def forget(self, backend: Backend, rids) -> None:
        """The client of ``rids`` went away: their answers on ``backend`` are no one's."""
        with self.lock:
            bs = self.open.get(backend.addr)
            if bs is None:
                return
            for rid in rids:
                bs.owners.pop(rid, None)
            self._idle(bs)

    def _idle(self, bs: "_Shared") -> None:
        """Nothing may be on ``bs`` now: close it after ``idle_s`` with nothing sent. Under ``self.lock``."""
        if bs.owners:
            return
        bs.idle_since = time.monotonic()
        if self.idle_s <= 0:
            self._close_if_idle(bs, locked=True)
        elif not bs.armed:
            bs.armed = True
            self.r.timer.call_later(self.idle_s, lambda: self._close_if_idle(bs))

    def _close_if_idle(self, bs: "_Shared", locked: bool = False) -> None:
        if not locked:
            with self.lock:
                return self._close_if_idle(bs, locked=True)
        bs.armed = False
        if bs.owners or self.open.get(bs.backend.addr) is not bs:
            return  # in use again (re-armed when it empties), or already gone
        left = bs.idle_since + self.idle_s - time.monotonic()
        if left > 0:  # used since the timer was set
            bs.armed = True
            self.r.timer.call_later(left, lambda: self._close_if_idle(bs))
            return
        del self.open[bs.backend.addr]
        bs.stream.close()  # (only queues the half-close: safe under the lock)
        self.r.metrics.backend_stream(bs.backend.addr, "idle_closed")

    def close(self) -> None:
        with self.lock:
            streams = list(self.open.values())
            self.open.clear()
        for bs in streams:
            bs.stream.close()


@dataclass(eq=False)
class _Shared:
    """A backend stream as ``BackendStreams`` keeps it: what is on it, by forwarded id, and its idle timer."""

    registry: BackendStreams
    backend: Backend
    stream: object = None  # the _BackendStream
    owners: dict = field(default_factory=dict)  # forwarded request id -> its _StreamSession
    broken: bool = False  # no new request goes on it
    armed: bool = False  # an idle check is due
    idle_since: float = 0.0


class _BackendStream:
    """The router's stream to one backend (``BackendStreams``). However it ends, what was on it is answered: an error
    status, a cancel the router did not ask for (its channel closed) or an end the backend chose while requests were
    in flight all retry them elsewhere or fail them (``BackendStreams.broken``); only the router's own ``cancel``
    (the backend was given up) and ``close`` (nothing was on it) do not."""

    def __init__(self, shared: _Shared, backend: Backend):
        self.shared, self.backend = shared, backend
        self.q: queue.Queue = queue.Queue()
        self.closed = self.cancelled = False
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
                    self.shared.registry.dispatch(self.shared, resp)
                except Exception:  # one bad response must not stop the stream's other requests (its own is answered)
                    log.exception("could not relay a response from %s", self.backend.addr)
            why = "the backend ended the stream"
        except grpc.RpcError as e:
            why = e.code().name
        if self.cancelled or self.closed:  # the router's own doing: nothing waits on it (closed only when empty)
            return
        self.shared.registry.broken(self.shared, why)

    def cancel(self) -> None:
        self.cancelled = True
        self.q.put(None)
        self.call.cancel()

    def close(self) -> None:
        self.closed = True
        self.q.put(None)


def response_id(resp) -> str:
    """The router-unique id a backend response answers (an error may carry it only in its text)."""
    return resp.infer_response.id or named(resp.error_message) or ""


def is_final(resp) -> bool:
    return FINAL in resp.infer_response.parameters and resp.infer_response.parameters[FINAL].bool_param
