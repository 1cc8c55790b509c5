"""The router's gRPC ports served by ``grpc.aio``: an idle stream costs a coroutine, not a thread.

The routing logic stays synchronous (``server.Router``; the endpoint picker's ``gateway.picker.EndpointPicker``,
whose ``PickerService`` runs on an ``AioServer`` too): a stream's coroutine reads the client's messages and hands
each to that logic on a worker thread only while it is being routed; responses come back from the backend threads
through the event loop. A unary call holds a worker while it is in flight (the
router bounds those: ``max_inflight``). Before this, a thread pool of 64 served every stream for its whole life:
64 idle streams left a new request neither served nor refused.

Bounds (``access.limits``): open streams in total and per client connection, refused at once with RESOURCE_EXHAUSTED;
a stream with nothing in flight that sent nothing for the idle timeout is ended with UNAVAILABLE (a transport
close, as gRPC's own connection idle timeout reports it: a request that crossed it on the wire is retried by the
client, since nothing was streamed for it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
from tritonclient.grpc import service_pb2_grpc

from ..access.auth import Forbidden, Keyring, Unauthenticated
from ..access.limits import IdleClock, StreamCounter, StreamLimits, StreamRefused
from .stream_session import _StreamSession

log = logging.getLogger("maskedit.router.aio")
UNARY = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
         "ModelStatistics", "RepositoryIndex", "ModelInfer", "RepositoryModelLoad", "RepositoryModelUnload")
OPEN = ("ServerLive", "ServerReady")  # probes: no key needed (as /health on the HTTP port)
ADMIN = ("RepositoryModelLoad", "RepositoryModelUnload")  # change the served set: admin keys only


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class ThreadContext:
    """What the synchronous handlers use of a servicer context, for an aio call, usable from any thread: ``abort``
    raises (the coroutine aborts the call), ``add_callback`` runs when the call ends (on a worker thread)."""

    def __init__(self, context):
        self._ctx = context
        self.tenant = None  # set by the transport once the call's key is checked (auth.Tenant)
        self.trailing: tuple = ()
        self._callbacks: list[Callable[[], None]] = []
        self._done = False
        self._lock = threading.Lock()

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Abort(code, details)

    def set_trailing_metadata(self, md) -> None:
        self.trailing = tuple(md)

    def time_remaining(self):
        return self._ctx.time_remaining()

    def peer(self) -> str:
        return self._ctx.peer()

    def is_active(self) -> bool:
        return not self._done

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return True
        return False

    def finish(self) -> None:
        with self._lock:
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:
                log.exception("a call's end callback failed")


class _LoopQueue:
    """``put`` from any thread into an asyncio queue of ``loop`` (a stream session's output)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.q = loop, asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped, nobody reads this stream any more
            pass


def _bind(context, work: ThreadPoolExecutor) -> ThreadContext:
    tctx = ThreadContext(context)
    loop = asyncio.get_running_loop()

    def done(_):
        try:
            loop.run_in_executor(work, tctx.finish)  # its callbacks may block (cancel calls to backends)
        except RuntimeError:  # the server is stopping: its executor is gone
            tctx.finish()

    context.add_done_callback(done)
    return tctx


class RouterService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The aio face of ``server.Router`` (Triton's ``GRPCInferenceService``)."""

    def __init__(self, router, limits: StreamLimits, keyring: Keyring | None = None):
        self.r, self.limits = router, limits
        self.keyring = keyring or Keyring()
        self.streams = StreamCounter(limits, "router")
        self._session = _StreamSession
        # routing a stream's message, ending a stream: short; unary calls hold a worker while in flight
        self.work = ThreadPoolExecutor(max_workers=32, thread_name_prefix="router-work")
        self.calls = ThreadPoolExecutor(max_workers=router.max_inflight + 64, thread_name_prefix="router-call")
        for name in UNARY:
            setattr(self, name, self._unary(name))

    def _unary(self, name: str):
        handler = getattr(self.r, name)

        async def call(request, context):
            tenant = None if name in OPEN else await self._authorize(context, admin=name in ADMIN)
            tctx = _bind(context, self.work)
            tctx.tenant = tenant
            try:
                return await asyncio.get_running_loop().run_in_executor(self.calls, handler, request, tctx)
            except _Abort as e:
                if tctx.trailing:
                    context.set_trailing_metadata(tctx.trailing)
                await context.abort(e.code, e.details)

        call.__name__ = name
        return call

    async def _authorize(self, context, admin: bool = False):
        """The call's tenant from its ``authorization`` metadata; aborts UNAUTHENTICATED / PERMISSION_DENIED."""
        value = None
        for k, v in context.invocation_metadata() or ():
            if k == "authorization":
                value = v
        try:
            return self.keyring.check(value, admin=admin)
        except Unauthenticated as e:
            self.r.metrics.auth_failed("grpc", "unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"UNAUTHENTICATED: {e}")
        except Forbidden as e:
            self.r.metrics.auth_failed("grpc", "forbidden")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"PERMISSION_DENIED: {e}")

    async def ModelStreamInfer(self, request_iterator, context):
        tenant = await self._authorize(context)
        peer = context.peer()
        try:
            self.streams.open(peer)
        except StreamRefused as e:
            self.r.metrics.refused(e.reason)
            self.r.refusals.note(e.reason, str(e))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.r.metrics.streams("router", self.streams.total)
        try:
            async for resp in self._stream(request_iterator, context, tenant):
                yield resp
        finally:
            self.streams.close(peer)
            self.r.metrics.streams("router", self.streams.total)

    async def _stream(self, request_iterator, context, tenant=None):
        loop = asyncio.get_running_loop()
        out = _LoopQueue(loop)
        tctx = _bind(context, self.work)
        tctx.tenant = tenant
        session = self._session(self.r, tctx, out=out)
        clock = IdleClock(self.limits.idle_timeout_s, loop.time())
        reader = asyncio.create_task(self._read(request_iterator, session, clock))
        try:
            while True:
                busy = session.busy()
                try:
                    item = await asyncio.wait_for(out.q.get(), clock.wait_s(busy, loop.time()))
                except asyncio.TimeoutError:
                    if clock.expired(session.busy(), loop.time()):
                        self.r.metrics.idle_closed("router")
                        log.info("idle stream closed", extra={"fields": {"peer": context.peer(),
                                                                         "idle_s": self.limits.idle_timeout_s}})
                        await context.abort(grpc.StatusCode.UNAVAILABLE, idle_message(self.limits.idle_timeout_s))
                    continue
                if item is None:
                    return
                clock.touch(loop.time())
                yield item
        finally:
            reader.cancel()

    async def _read(self, request_iterator, session, clock: IdleClock) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for req in request_iterator:
                clock.touch(loop.time())
                await loop.run_in_executor(self.work, session.submit, req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the client went away mid-read
            log.info("client stream ended: %s", e)
        finally:
            session.reading = False
            session._maybe_finish()

    def close(self) -> None:
        self.work.shutdown(wait=False, cancel_futures=True)
        self.calls.shutdown(wait=False, cancel_futures=True)


def idle_message(idle_s: float) -> str:
    return (f"UNAVAILABLE: stream idle for {idle_s:g} s with nothing in flight (stream_idle_timeout_s); closed by "
            "the router, open a new stream")


class AioServer:
    """A ``grpc.aio`` server on an event loop of its own (a thread), stopped as a sync one:
    ``stop(grace).wait(timeout)``."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()
        self.server: grpc.aio.Server | None = None
        self.on_stop: list[Callable[[], None]] = []
        self.loopback_port: int | None = None

    def start(self, setup: Callable[[grpc.aio.Server], None], address: str, options: list,
              credentials: grpc.ServerCredentials | None = None, loopback: bool = False) -> int:
        """Serve on ``address`` (TLS with ``credentials``); ``loopback``: also on a plaintext port of 127.0.0.1
        (``loopback_port``), which the router's own HTTP ports call through when the public one is TLS (keys are
        checked there all the same)."""
        async def go():
            self.server = grpc.aio.server(options=options)
            setup(self.server)
            if credentials is not None:
                port = self.server.add_secure_port(address, credentials)
                if loopback:
                    self.loopback_port = self.server.add_insecure_port("127.0.0.1:0")
            else:
                port = self.server.add_insecure_port(address)
            await self.server.start()
            return port

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(30)

    def stop(self, grace: float | None = None) -> threading.Event:
        done = threading.Event()

        async def go():
            try:
                if self.server is not None:
                    await self.server.stop(grace)
            finally:
                for fn in self.on_stop:
                    fn()
                self.loop.call_soon(self.loop.stop)
                done.set()

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(go(), self.loop)
        else:
            done.set()
        return done
