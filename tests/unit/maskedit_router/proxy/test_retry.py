"""Retrying UNAVAILABLE before any response: the rule, the client against a fake endpoint that breaks its streams,
and the router's forward path when no backend is up."""

import json
import struct
import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from maskedit_client import EditClient, EditError
from maskedit_client.retry import Backoff, Timer, retryable

IMG = np.zeros((8, 8), np.uint8)


def test_only_unavailable_before_any_response_is_retried():
    assert retryable("UNAVAILABLE", responded=False)
    assert not retryable("UNAVAILABLE", responded=True)  # its caller may have seen part of it: never replayed
    for code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"):
        assert not retryable(code, responded=False)


def test_backoff_grows_exponentially_with_jitter_up_to_its_cap_and_stops_at_the_deadline():
    b = Backoff(first_s=0.1, max_s=1.0, factor=2.0, jitter=0.5)
    assert [b.delay(n, rand=0.0) for n in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert b.delay(2, rand=1.0) == pytest.approx(0.2)  # jitter takes off at most half
    assert b.next(0, deadline=10.0, now=9.0, rand=0.0) == pytest.approx(0.1)
    assert b.next(3, deadline=10.0, now=9.5, rand=0.0) is None  # 0.8 s would end past the deadline


def test_the_timer_runs_calls_in_due_order_on_one_thread():
    # b is due 0.5 s after it is scheduled, a at once: only a preemption of the test of over 0.5 s between the two
    # calls would make b due first (0.05 s was once exceeded at load 8)
    t, out, threads, done = Timer(), [], set(), threading.Event()
    t.call_later(0.5, lambda: (out.append("b"), threads.add(threading.get_ident()), done.set()))
    t.call_later(0.0, lambda: (out.append("a"), threads.add(threading.get_ident())))
    assert done.wait(5) and out == ["a", "b"]
    assert len(threads) == 1 and threading.get_ident() not in threads


class _Flaky(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A Triton stand-in: ``script`` says, per request, what it does with it: ``break`` ends the stream with
    UNAVAILABLE, ``progress-break`` streams a progress response first, ``ok`` answers with an image and the empty
    final response, ``invalid`` answers an INVALID_ARGUMENT error, ``refuse`` a full queue's refusal."""

    def __init__(self, script):
        self.script, self.seen = list(script), []

    def ModelStreamInfer(self, request_iterator, context):
        for req in request_iterator:
            self.seen.append(req.id)
            what = self.script.pop(0) if self.script else "ok"
            if what == "progress-break":
                yield _response(req.id, {"progress": [1, 2]}, final=False)
            if what.endswith("break"):
                context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            if what in ("invalid", "refuse"):
                text = "INVALID_ARGUMENT: PROMPT: empty" if what == "invalid" else \
                    "UNAVAILABLE: RESOURCE_EXHAUSTED: the denoise queue is full"  # Triton 2.51's refusal
                yield service_pb2.ModelStreamInferResponse(error_message=f"{text} [request id: {req.id}]")
                continue
            yield _response(req.id, {"seed": 7}, final=False)
            yield _response(req.id, None, final=True)


def _response(rid, info, final):
    resp = service_pb2.ModelStreamInferResponse()
    r = resp.infer_response
    r.id = rid
    r.parameters["triton_final_response"].bool_param = final
    if info is not None:
        for name, value in (("IMAGE", b"png"), ("EDIT_INFO", json.dumps(info).encode())):
            o = r.outputs.add()
            o.name, o.datatype = name, "BYTES"
            o.shape.append(1)
            r.raw_output_contents.append(struct.pack("<I", len(value)) + value)  # Triton's BYTES layout
    return resp


@pytest.fixture
def endpoint(serve):
    def start(script):
        fake = _Flaky(script)
        return fake, serve(fake)

    return start


def test_a_stream_broken_before_any_response_is_retried_on_a_new_stream(endpoint):
    fake, url = endpoint(["break", "break"])
    with EditClient(url, backoff=Backoff(first_s=0.05)) as c:
        r = c.submit(IMG, IMG, "a hat", seed=7).result(10)
    assert r.info == {"seed": 7}
    assert len(fake.seen) == 3 and len(set(fake.seen)) == 1  # the same request, three times


def test_a_request_that_streamed_a_response_is_never_replayed(endpoint):
    fake, url = endpoint(["progress-break"])
    with EditClient(url, backoff=Backoff(first_s=0.05)) as c:
        with pytest.raises(EditError) as e:
            c.submit(IMG, IMG, "a hat", on_progress=lambda *a: None).result(10)
    assert e.value.code == "UNAVAILABLE" and len(fake.seen) == 1


def test_other_errors_are_not_retried_and_retry_can_be_turned_off(endpoint):
    fake, url = endpoint(["invalid", "break"])
    with EditClient(url, retry=False) as c:
        with pytest.raises(EditError) as e:
            c.submit(IMG, IMG, "").result(10)
        assert e.value.code == "INVALID_ARGUMENT"
        with pytest.raises(EditError) as e:
            c.submit(IMG, IMG, "a hat").result(10)
        assert e.value.code == "UNAVAILABLE"
    assert len(fake.seen) == 2


def test_a_backends_refusal_is_an_answer_not_an_outage(endpoint):
    fake, url = endpoint(["refuse"])
    with EditClient(url, backoff=Backoff(first_s=0.05)) as c:
        with pytest.raises(EditError) as e:
            c.submit(IMG, IMG, "a hat").result(10)
    assert "RESOURCE_EXHAUSTED" in str(e.value) and len(fake.seen) == 1  # not sent again


def test_retries_end_at_the_requests_deadline(endpoint):
    with EditClient("127.0.0.1:1", timeout_s=30, backoff=Backoff(first_s=0.05, max_s=0.2)) as c:
        t0 = time.monotonic()
        with pytest.raises(EditError) as e:
            c.submit(IMG, IMG, "a hat", deadline_ms=1000).result(10)  # nobody listens there
        took = time.monotonic() - t0
    assert e.value.code == "UNAVAILABLE" and 0.5 < took < 2.0


def test_an_endpoint_that_comes_back_within_the_deadline_serves_the_request():
    """A router restart: nothing listens for a while, then it does, on the same port."""
    from maskedit.launcher import free_port

    port = free_port()
    fake = _Flaky([])
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, srv)
    with EditClient(f"127.0.0.1:{port}", backoff=Backoff(first_s=0.05, max_s=0.3)) as c:
        fut = c.submit(IMG, IMG, "a hat")
        time.sleep(1.0)
        assert not fut.done()
        srv.add_insecure_port(f"127.0.0.1:{port}")
        srv.start()
        try:
            assert fut.result(10).info == {"seed": 7}
        finally:
            srv.stop(0)


# -- the router's forward path ----------------------------------------------------------------------
@pytest.fixture
def session(monkeypatch):
    from maskedit_common.cost_model import CostModel
    from maskedit_router.placement.policies import Estimator, make
    from maskedit_router.proxy import backend_streams, server, stream_session

    from .test_server_faults import _Stream

    monkeypatch.setattr(backend_streams, "_BackendStream", _Stream)
    monkeypatch.setattr(_Stream, "sent", [])
    est = Estimator(CostModel.fallback())
    router = server.Router(["a:1"], make("round_robin", est), est, retry_budget_s=1.0)
    router.backoff = Backoff(first_s=0.05, max_s=0.1)
    ctx = SimpleNamespace(add_callback=lambda cb: None, is_active=lambda: True)
    s = stream_session._StreamSession(router, ctx)
    yield s
    for b in router.backends.values():
        b.close()


def _deadline_request(rid, deadline_ms=None):
    req = service_pb2.ModelInferRequest(model_name="edit", id=rid)
    if deadline_ms is not None:
        t = req.inputs.add()
        t.name, t.datatype = "DEADLINE_MS", "INT64"
        t.shape.append(1)
        t.contents.int64_contents.append(deadline_ms)
    return req


def test_the_router_holds_a_request_while_no_backend_is_up_and_sends_it_when_one_is(session):
    from .test_server_faults import _Stream

    backend = session.r.backends["a:1"]
    backend.load.healthy = False  # restarting
    session.submit(_deadline_request("mine", deadline_ms=5000))
    time.sleep(0.3)
    assert _Stream.sent == [] and session.out.empty() and session.busy()  # waiting, not failed, not idle
    backend.load.healthy = True
    deadline = time.monotonic() + 2
    while not _Stream.sent and time.monotonic() < deadline:
        time.sleep(0.02)
    (addr, rid), = _Stream.sent
    sent = session.pending[rid].request
    assert addr == "a:1" and 4000 < sent.inputs[0].contents.int64_contents[0] < 5000  # what is left of its deadline


def test_the_router_fails_a_request_at_its_deadline_when_no_backend_comes_back(session):
    session.r.backends["a:1"].load.healthy = False
    t0 = time.monotonic()
    session.submit(_deadline_request("mine"))  # no DEADLINE_MS: the router's retry budget (1 s)
    err = session.out.get(timeout=5)
    assert 0.7 < time.monotonic() - t0 < 4.0  # at the 1 s budget (a busy host's scheduling aside), not held on
    assert err.infer_response.id == "mine" and err.error_message.startswith("UNAVAILABLE: no healthy backend")
    assert "retried" in err.error_message and not session.busy()


def test_the_router_does_not_retry_a_refusal(session):
    session.r.max_inflight = 0  # full: RESOURCE_EXHAUSTED is an answer, not an outage
    session.submit(_deadline_request("mine"))
    err = session.out.get_nowait()
    assert err.error_message.startswith("RESOURCE_EXHAUSTED")
