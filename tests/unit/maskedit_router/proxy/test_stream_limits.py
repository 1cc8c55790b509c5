"""The router's gRPC port is bounded by configured stream limits, not by threads: its rules alone, then the real
aio server (no Triton: a fake backend that holds what it is sent)."""

import queue
import threading
import time

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from maskedit_router.__main__ import build, main, serve
from maskedit_router.access.limits import IdleClock, StreamCounter, StreamLimits, StreamRefused


def test_streams_beyond_the_total_or_the_connections_limit_are_refused_naming_the_limit():
    c = StreamCounter(StreamLimits(max_streams=3, max_streams_per_connection=2))
    c.open("a")
    c.open("a")
    with pytest.raises(StreamRefused, match="max_streams_per_connection 2") as e:
        c.open("a")
    assert e.value.reason == "streams_connection"
    c.open("b")
    with pytest.raises(StreamRefused, match=r"max_streams 3\)") as e:
        c.open("c")
    assert e.value.reason == "streams_total"
    c.close("a")
    c.open("c")  # a closed stream frees its place
    c.close("a")
    assert c.by_peer == {"b": 1, "c": 1} and c.total == 2


def test_a_stream_is_idle_only_with_nothing_in_flight_for_the_whole_timeout():
    clock = IdleClock(10.0, now=0.0)
    assert not clock.expired(busy=False, now=9.9)
    assert clock.expired(busy=False, now=10.0)
    assert not clock.expired(busy=True, now=100.0)  # a long edit in flight is not idle
    clock.touch(100.0)  # it ended: the clock starts again
    assert not clock.expired(busy=False, now=105.0) and clock.wait_s(False, 105.0) == pytest.approx(5.0)
    off = IdleClock(0.0, now=0.0)
    assert not off.expired(busy=False, now=1e9) and off.wait_s(False, 1e9) is None


@pytest.mark.parametrize("field,value", [("max_streams", 0), ("max_streams_per_connection", -1),
                                         ("idle_timeout_s", -1.0)])
def test_bad_limits_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        StreamLimits(**{field: value})


def test_the_router_command_refuses_bad_limits_naming_the_field(capsys):
    with pytest.raises(SystemExit):
        main(["--backends", "a:1", "--max-streams-per-connection", "0"])
    assert "max_streams_per_connection: must be at least 1" in capsys.readouterr().err


class _HoldingBackend(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A backend that takes stream requests and answers only when told."""

    def __init__(self):
        self.got: queue.Queue = queue.Queue()
        self.release = threading.Event()
        self.streams = 0  # streams the router opened to it

    def ModelStreamInfer(self, request_iterator, context):
        self.streams += 1
        for req in request_iterator:
            self.got.put(req.id)
            self.release.wait(30)
            resp = service_pb2.ModelStreamInferResponse()
            resp.infer_response.id = req.id
            resp.infer_response.parameters["triton_final_response"].bool_param = True
            yield resp


@pytest.fixture
def router(request):
    from concurrent import futures

    backend = _HoldingBackend()
    bsrv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(backend, bsrv)
    bport = bsrv.add_insecure_port("127.0.0.1:0")
    bsrv.start()
    r = build([f"127.0.0.1:{bport}"], resolution=256)
    srv, port, _ = serve(r, 0, None, limits=StreamLimits(max_streams=150, max_streams_per_connection=100,
                                                         idle_timeout_s=getattr(request, "param", 30.0)))
    channels = []

    def connect():  # a connection of its own (channels with equal arguments share one)
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(ch)
        return service_pb2_grpc.GRPCInferenceServiceStub(ch)

    yield {"router": r, "backend": backend, "connect": connect}
    backend.release.set()
    for ch in channels:
        ch.close()
    srv.stop(0).wait(10)
    bsrv.stop(0).wait(10)
    for b in r.backends.values():
        b.close()


def _stream(stub, timeout=30):
    """A stream whose requests the test sends: ``(q, responses)``; ``q.put(None)`` half-closes it."""
    q: queue.Queue = queue.Queue()
    return q, stub.ModelStreamInfer(iter(q.get, None), timeout=timeout)


def _request(rid: str):
    """An edit request that asks for the empty final response (the fake backend sends nothing else)."""
    req = service_pb2.ModelInferRequest(model_name="edit", id=rid)
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_idle_streams_beyond_the_old_thread_pool_do_not_starve_a_new_request(router):
    """The issue: 64 idle streams held the 64 threads, and a new request waited 20 s. Now 140 idle streams (on two
    connections) leave a new stream's request and a unary call answered at once, and the next stream past the
    limit is refused at once."""
    a, b = router["connect"](), router["connect"]()
    idle = [_stream(a) for _ in range(100)] + [_stream(b) for _ in range(40)]
    assert _wait(lambda: router["router"].metrics.streams_open.labels("router")._value.get() == 140)
    t0 = time.monotonic()
    assert b.ServerLive(service_pb2.ServerLiveRequest(), timeout=5).live
    q, responses = _stream(b)
    q.put(_request("mine"))
    assert router["backend"].got.get(timeout=5)  # routed to the backend
    router["backend"].release.set()
    assert next(responses).infer_response.id == "mine"
    assert time.monotonic() - t0 < 15.0  # the starved request waited 20 s; a host at load 8 needs slack
    c = router["connect"]()
    more = [_stream(c) for _ in range(9)]  # 150 open: the limit
    assert _wait(lambda: router["router"].metrics.streams_open.labels("router")._value.get() == 150)
    _, refused = _stream(c)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        next(refused)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams 150" in e.value.details()
    assert time.monotonic() - t0 < 15.0  # refused, not left open (an uncapped one would wait out its 30 s timeout)
    for q_, _ in idle + more:
        q_.put(None)


def test_a_connection_over_its_limit_is_refused_while_others_are_served(router):
    a = router["connect"]()
    held = [_stream(a) for _ in range(100)]
    assert _wait(lambda: router["router"].metrics.streams_open.labels("router")._value.get() == 100)
    _, over = _stream(a)
    with pytest.raises(grpc.RpcError) as e:
        next(over)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_connection 100" in \
        e.value.details()
    q, ok = _stream(router["connect"]())  # another connection is served
    router["backend"].release.set()
    q.put(_request("other"))
    assert next(ok).infer_response.id == "other"
    assert router["router"].metrics.refusals.labels("streams_connection")._value.get() == 1
    for q_, _ in held:
        q_.put(None)


@pytest.mark.parametrize("router", [1.0], indirect=True)  # idle timeout
def test_an_idle_stream_is_ended_but_one_with_a_request_in_flight_is_not(router):
    stub = router["connect"]()
    t0 = time.monotonic()  # before the idle stream exists: its timer cannot start earlier, however late the rest is
    _, idle = _stream(stub)
    busy_q, busy = _stream(stub)
    busy_q.put(_request("slow"))
    assert router["backend"].got.get(timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        next(idle)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stream_idle_timeout_s" in e.value.details()
    assert 0.8 < time.monotonic() - t0 < 10.0  # at the 1 s idle timeout, not before (a busy host may be late)
    time.sleep(1.5)  # the busy one outlives the idle timeout while its request is in flight
    router["backend"].release.set()
    assert next(busy).infer_response.id == "slow"
    assert router["router"].metrics.idle.labels("router")._value.get() == 1


def test_a_client_that_goes_away_frees_its_streams(router):
    stub = router["connect"]()
    calls = [_stream(stub)[1] for _ in range(20)]
    gauge = router["router"].metrics.streams_open.labels("router")
    assert _wait(lambda: gauge._value.get() == 20)
    for c in calls:
        c.cancel()
    assert _wait(lambda: gauge._value.get() == 0, 5.0)


def _backend_threads(router) -> list:
    addr = next(iter(router["router"].backends))
    return [t for t in threading.enumerate() if t.name == f"router-{addr}"]


def _opened(router, event="opened") -> float:
    addr = next(iter(router["router"].backends))
    return router["router"].metrics.backend_streams.labels(addr, event)._value.get()


@pytest.mark.parametrize("idle_s", [30.0, 0.0])
def test_client_streams_share_one_backend_stream(router, idle_s):
    """Requests from several client streams (on two connections), each sent after the last answer, go on one backend
    stream: the backend sees one stream, not one per request. The control (idle 0: closed as soon as nothing is on it,
    as the router did before) opens one per request, which is what cost ~2.2 ms of router CPU each."""
    router["router"].backend_streams.idle_s = idle_s
    router["backend"].release.set()
    clients = [_stream(router["connect"]()) for _ in range(2) for _ in range(3)]  # 3 streams on each connection
    n = 0
    for turn in range(2):
        for i, (q, responses) in enumerate(clients):
            q.put(_request(f"r{turn}-{i}"))
            assert next(responses).infer_response.id == f"r{turn}-{i}"
            n += 1
    if idle_s:
        assert router["backend"].streams == 1 and _opened(router) == 1 and len(_backend_threads(router)) == 1
    else:
        assert _wait(lambda: router["backend"].streams == n) and _opened(router) == n
    for q, _ in clients:
        q.put(None)


@pytest.mark.parametrize("idle_s", [0.3, 30.0])
def test_an_idle_backend_stream_is_closed_and_reopened_when_needed(router, idle_s):
    """A backend stream with nothing on it for the idle time is closed (its thread ends); the next request opens a
    new one. The control (30 s) keeps it open."""
    router["router"].backend_streams.idle_s = idle_s
    router["backend"].release.set()
    q, responses = _stream(router["connect"]())
    q.put(_request("one"))
    assert next(responses).infer_response.id == "one"
    assert len(_backend_threads(router)) == 1
    time.sleep(0.3 + 0.5)
    closed = _wait(lambda: not _backend_threads(router), 3.0)
    assert closed == (idle_s < 1) and _opened(router, "idle_closed") == (1 if closed else 0)
    q.put(_request("two"))
    assert next(responses).infer_response.id == "two"
    assert router["backend"].streams == (2 if closed else 1)
    q.put(None)


class _BreakingBackend(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Takes stream requests without answering until ``n`` are in, then fails the stream (UNAVAILABLE)."""

    def __init__(self, n: int):
        self.n, self.got, self.streams = n, queue.Queue(), 0

    def ModelStreamInfer(self, request_iterator, context):
        self.streams += 1
        for i, req in enumerate(request_iterator, 1):
            self.got.put(req.id)
            if i == self.n:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the backend's stream broke")
        return
        yield


def test_a_broken_shared_stream_ends_every_request_on_it_once():
    """Three client streams' requests share the backend stream; it breaks with none answered: each client gets one
    error for its request (no backend left to retry on), and the backend counts one failure, not three."""
    from concurrent import futures

    backend = _BreakingBackend(3)
    bsrv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(backend, bsrv)
    bport = bsrv.add_insecure_port("127.0.0.1:0")
    bsrv.start()
    r = build([f"127.0.0.1:{bport}"], resolution=256)
    r.retry_budget_s = 0  # no waiting for a backend to come back: the error is immediate
    srv, port, _ = serve(r, 0, None, limits=StreamLimits())
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        clients = [_stream(stub) for _ in range(3)]
        for i, (q, _) in enumerate(clients):
            q.put(_request(f"c{i}"))
        for i, (q, responses) in enumerate(clients):
            resp = next(responses)
            assert resp.infer_response.id == f"c{i}" and resp.error_message.startswith("UNAVAILABLE")
            q.put(None)
            assert list(responses) == []  # one answer each, then the stream ends
        assert backend.streams == 1
        assert next(iter(r.backends.values())).failures == 1
    finally:
        ch.close()
        srv.stop(0).wait(10)
        bsrv.stop(0).wait(10)
        for b in r.backends.values():
            b.close()
