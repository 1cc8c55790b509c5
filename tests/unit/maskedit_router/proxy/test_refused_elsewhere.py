"""A backend's RESOURCE_EXHAUSTED before anything of a request reached its client is retried on another backend
with room; the client sees a refusal only when every backend is full. After a router restart the clients' retried
burst met one backend's full queue while the other had room, and was refused (issue 47)."""

import time
from types import SimpleNamespace

import grpc
import pytest
from tritonclient.grpc import service_pb2

from .test_server_faults import _Aborted, _drain, _Failed, _response, _Stream, _unary_router
from .test_server_faults import session  # noqa: F401 (fixture)

FULL = "RESOURCE_EXHAUSTED: the denoise queue is full (2 waiting); retry later"


def test_a_refused_request_goes_to_the_backend_with_room_and_its_client_sees_only_the_result(session):
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    (first, rid), = _Stream.sent
    full = session.r.backends[first]
    session.on_response(full, _response(rid, f"{FULL} [request id: {rid}]"))
    (other, again), = [(a, r) for a, r in _Stream.sent[1:]]
    assert other != first and again == rid
    assert _drain(session.out) == []  # the refusal was not relayed
    assert full.available(time.monotonic()) and full.failures == 0  # full, not failed: it stays in rotation
    session.on_response(session.r.backends[other], _response(rid, final=True))
    assert session.pending == {} and all(b.load.inflight == 0 for b in session.r.backends.values())
    assert session.r.metrics.retries.labels(first, "refused")._value.get() == 1


def test_the_client_gets_the_refusal_when_every_backend_is_full(session):
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    for _ in range(2):
        addr, rid = _Stream.sent[-1]
        session.on_response(session.r.backends[addr], _response(rid, f"{FULL} [request id: {rid}]"))
    assert len(_Stream.sent) == 2  # each backend once: no third send, no backoff loop
    (err,) = _drain(session.out)
    assert err.infer_response.id == "mine" and err.error_message.startswith("RESOURCE_EXHAUSTED")
    assert "request id: mine" in err.error_message and rid not in err.error_message
    assert session.pending == {} and all(b.load.inflight == 0 for b in session.r.backends.values())


def test_a_refusal_after_progress_is_relayed_not_retried(session):
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    (addr, rid), = _Stream.sent
    session.on_response(session.r.backends[addr], _response(rid))  # progress reached the client
    session.on_response(session.r.backends[addr], _response(rid, f"{FULL} [request id: {rid}]"))
    assert len(_Stream.sent) == 1
    progress, err = _drain(session.out)
    assert err.error_message.startswith("RESOURCE_EXHAUSTED")


def test_a_unary_refusal_is_retried_on_the_other_backend_and_is_no_failure():
    router, ctx, _, answer = _unary_router()
    full = router.backends["a:1"]
    full.stub = SimpleNamespace(ModelInfer=SimpleNamespace(
        future=lambda req, timeout: _Failed(grpc.StatusCode.UNAVAILABLE, FULL)))
    for _ in range(4):  # more than the breaker's threshold: a full backend is not a failing one
        assert router.ModelInfer(service_pb2.ModelInferRequest(model_name="cancel"), ctx) is answer
    assert full.failures == 0 and full.available(time.monotonic())


def test_a_unary_refusal_reaches_the_caller_when_every_backend_is_full():
    router, ctx, _, _ = _unary_router()
    for b in router.backends.values():
        b.stub = SimpleNamespace(ModelInfer=SimpleNamespace(
            future=lambda req, timeout: _Failed(grpc.StatusCode.UNAVAILABLE, FULL)))
    t0 = time.monotonic()
    with pytest.raises(_Aborted) as err:
        router.ModelInfer(service_pb2.ModelInferRequest(model_name="cancel"), ctx)
    assert err.value.args == (grpc.StatusCode.RESOURCE_EXHAUSTED, FULL)
    assert time.monotonic() - t0 < 1.0  # at once, not after the retry budget's backoff



def test_in_an_overload_a_refusal_is_not_sent_to_wait_at_another_refusing_backend(session):
    """Every backend refusing (an overload, not a burst): a second wait in front of another check would only make
    the refusal late. The client gets the first refusal at once."""
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    (first, rid), = _Stream.sent
    now = time.monotonic()
    for b in session.r.backends.values():
        b.admission.backend_refused(now)  # both refused a request a moment ago
    session.on_response(session.r.backends[first], _response(rid, f"{FULL} [request id: {rid}]"))
    assert len(_Stream.sent) == 1
    (err,) = _drain(session.out)
    assert err.error_message.startswith("RESOURCE_EXHAUSTED")
    assert session.r.metrics.refusals.labels("admission")._value.get() == 0  # the backend's refusal, not the router's


def test_a_request_left_waiting_at_a_refusing_backend_moves_to_one_with_room(session):
    """The router's backstop: it waited its admission wait in front of a backend that refuses. With another backend
    not refusing, it is moved there instead of refused; the first backend's answer for it ("cancelled", sent when
    the cancel reaches pre-processing) is not relayed, nor taken for the moved request's."""
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    (first, rid), = _Stream.sent
    session.r.backends[first].admission.backend_refused(time.monotonic())
    assert session.expire(rid)
    (other, again), = _Stream.sent[1:]
    assert other != first and again == rid and session.pending[rid].ticket.backend.addr == other
    session.on_response(session.r.backends[first], _response(
        rid, f"in ensemble 'edit', cancelled before pre-processing [request id: {rid}]"))
    assert rid in session.pending and _drain(session.out) == []  # the first backend's answer is not the client's
    done = _response(rid, final=True)
    session.on_response(session.r.backends[other], done)
    assert session.pending == {} and session.r.metrics.retries.labels(first, "waited")._value.get() == 1


def test_a_request_left_waiting_is_refused_when_no_backend_has_room(session):
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    (first, rid), = _Stream.sent
    for b in session.r.backends.values():
        b.admission.backend_refused(time.monotonic())
    assert session.expire(rid)
    assert len(_Stream.sent) == 1
    (err,) = _drain(session.out)
    assert err.error_message.startswith("RESOURCE_EXHAUSTED: waited") and "request id: mine" in err.error_message
