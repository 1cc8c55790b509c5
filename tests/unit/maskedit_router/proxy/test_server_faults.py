"""A backend whose Python stub died answers every request with an error at once (Triton 2.51 does not restart the
stub and keeps saying ready): the router must read that as "never reached a live model", not as a live backend
rejecting one request."""

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from tritonclient.grpc import service_pb2

from maskedit_common.cost_model import CostModel
from maskedit_router.placement.policies import Estimator, make
from maskedit_router.proxy import backend_streams, server, stream_session

# Triton 2.51's answer for a request to a model whose stub died (the integration test checks the real text)
DEAD_STUB = ("Failed to process the request(s) for model 'masked_denoise_0_0', message: "
             "Stub process 'masked_denoise_0_0' is not healthy.")


class _Stream:
    """Stands in for a backend stream: records what the session sends where."""

    sent: list = []

    def __init__(self, session, backend):
        self.backend, self.broken = backend, False

    def send(self, req):
        self.sent.append((self.backend.addr, req.id))

    def cancel(self):
        self.broken = True

    def close(self):
        pass


@pytest.fixture
def session(monkeypatch):
    monkeypatch.setattr(backend_streams, "_BackendStream", _Stream)
    monkeypatch.setattr(_Stream, "sent", [])
    est = Estimator(CostModel.fallback())
    router = server.Router(["a:1", "b:2"], make("round_robin", est), est, retry_budget_s=0)  # test_retry: > 0
    s = stream_session._StreamSession(router, SimpleNamespace(add_callback=lambda cb: None, is_active=lambda: True))
    yield s
    for b in router.backends.values():
        b.close()


def _response(rid: str, error: str = "", final: bool = False):
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    resp.infer_response.id = rid
    if final:
        resp.infer_response.parameters[server.FINAL].bool_param = True
    return resp


def _drain(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_the_dead_stub_message_is_a_backend_fault_and_ordinary_errors_are_not():
    assert server.backend_fault(DEAD_STUB)
    assert not server.backend_fault("in 0: MASK: expected a PNG or JPEG image")
    assert not server.backend_fault("")


def test_a_request_answered_by_a_dead_stub_is_retried_elsewhere_and_the_backend_leaves_rotation(session):
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    (addr, rid), = _Stream.sent
    dead = session.r.backends[addr]
    session.on_response(dead, _response(rid, DEAD_STUB))
    assert _Stream.sent[1][1] == rid and _Stream.sent[1][0] != addr  # same request, the other backend
    assert _drain(session.out) == []  # the client saw nothing of the failure
    assert not dead.available(time.monotonic())  # out of rotation at once, not after three failures
    assert dead.last_answer == 0.0  # its error is not a sign of life for the health checker
    other = session.r.backends[_Stream.sent[1][0]]
    session.on_response(other, _response(rid, final=True))
    assert session.pending == {}


def test_a_request_that_had_streamed_is_not_replayed_after_a_dead_stub_answer(session):
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    (addr, rid), = _Stream.sent
    dead = session.r.backends[addr]
    session.on_response(dead, _response(rid))  # a progress response reached the client
    session.on_response(dead, _response(rid, DEAD_STUB))
    assert len(_Stream.sent) == 1  # not sent again
    progress, err = _drain(session.out)
    assert err.infer_response.id == "mine" and err.error_message.startswith("UNAVAILABLE")
    assert session.pending == {}


def test_a_request_retried_twice_never_returns_to_a_backend_that_failed_it(session):
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="mine"))
    for _ in range(2):
        addr, rid = _Stream.sent[-1]
        session.on_response(session.r.backends[addr], _response(rid, DEAD_STUB))
    assert len(_Stream.sent) == 2  # both backends failed it: no third send
    (err,) = _drain(session.out)
    assert err.infer_response.id == "mine" and "UNAVAILABLE" in err.error_message


class _Hung:
    """A unary call on a backend that accepted it and never answers."""

    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()
        return True

    def result(self):
        assert self.cancelled.wait(10), "never cancelled"
        raise grpc.FutureCancelledError()


class _Answered:
    def __init__(self, resp):
        self.resp = resp

    def cancel(self):
        return False

    def result(self):
        return self.resp


class _Aborted(Exception):
    pass


def _unary_router(active=True):
    est = Estimator(CostModel.fallback())
    router = server.Router(["a:1", "b:2"], make("round_robin", est), est)
    hung, answer = _Hung(), service_pb2.ModelInferResponse(model_name="cancel")
    futures = {"a:1": lambda req, timeout: hung, "b:2": lambda req, timeout: _Answered(answer)}
    for addr, b in router.backends.items():
        b.stub = SimpleNamespace(ModelInfer=SimpleNamespace(future=futures[addr]))

    def abort(code, details):
        raise _Aborted(code, details)

    ctx = SimpleNamespace(time_remaining=lambda: None, add_callback=lambda cb: True, is_active=lambda: active,
                          abort=abort)
    return router, ctx, hung, answer


def _call_in_thread(router, ctx):
    out = {}

    def call():
        try:
            out["resp"] = router.ModelInfer(service_pb2.ModelInferRequest(model_name="cancel"), ctx)
        except _Aborted as e:
            out["aborted"] = e.args
    th = threading.Thread(target=call)
    th.start()
    deadline = time.monotonic() + 5
    while not router._unary and time.monotonic() < deadline:  # in flight on the first backend
        time.sleep(0.01)
    return th, out


def test_a_unary_call_stuck_on_a_backend_found_down_is_retried_on_another():
    router, ctx, hung, answer = _unary_router()
    th, out = _call_in_thread(router, ctx)
    router.backend_down(router.backends["a:1"], "health check failed")
    th.join(10)
    assert hung.cancelled.is_set() and out == {"resp": answer}
    assert router._unary == set()


def test_a_unary_call_the_client_gave_up_on_ends_cancelled_and_is_not_retried():
    router, ctx, hung, _ = _unary_router(active=False)
    th, out = _call_in_thread(router, ctx)
    hung.cancel()  # what the client's cancellation callback does
    th.join(10)
    assert out["aborted"][0] == grpc.StatusCode.CANCELLED


class _Failed(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def cancel(self):
        return False

    def result(self):
        raise self


def test_a_unary_call_answered_by_a_dead_stub_is_retried_and_the_backend_leaves_rotation():
    router, ctx, _, answer = _unary_router()
    dead = router.backends["a:1"]
    dead.stub = SimpleNamespace(ModelInfer=SimpleNamespace(
        future=lambda req, timeout: _Failed(grpc.StatusCode.INTERNAL, DEAD_STUB)))
    assert router.ModelInfer(service_pb2.ModelInferRequest(model_name="cancel"), ctx) is answer
    assert not dead.available(time.monotonic())
    rejected = _Failed(grpc.StatusCode.INVALID_ARGUMENT, "in 0: MASK: expected a PNG or JPEG image")
    router.backends["b:2"].stub = SimpleNamespace(ModelInfer=SimpleNamespace(future=lambda req, timeout: rejected))
    with pytest.raises(_Aborted) as err:  # an ordinary error is the request's: relayed, not retried
        router.ModelInfer(service_pb2.ModelInferRequest(model_name="cancel"), ctx)
    assert err.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT


# -- the router's errors reach the right caller through tritonclient and EditClient ------------------------------
from concurrent.futures import Future  # noqa: E402

from tritonclient.grpc import InferResult  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from maskedit_client import EditClient, EditError  # noqa: E402


def _client_with_pending(ids):
    """An EditClient (never connected) with ``ids`` pending, as after ``submit`` on one stream."""
    c = EditClient("127.0.0.1:1")
    futs = {}
    for i in ids:
        futs[i] = Future()
        c._pending[i] = (futs[i], {})
    return c, futs


def _deliver(client, resp) -> None:
    """What tritonclient's stream thread does with one response: an error reaches the callback as its text only
    (the response's id field is dropped), anything else as an InferResult."""
    if resp.error_message:
        client._on_response(None, InferenceServerException(msg=resp.error_message))
    else:
        client._on_response(InferResult(resp.infer_response), None)


def test_a_request_cut_off_after_streaming_fails_for_its_own_caller_with_several_pending(session):
    """Issue 16's lost request: a backend died after one of several requests on a stream had streamed progress.
    The router fails it (not replayable) and retries the others; its error must reach that request's caller,
    not be dropped because several are pending."""
    for i in range(3):
        session.submit(service_pb2.ModelInferRequest(model_name="edit", id=f"c-{i}"))
    addr, rid = _Stream.sent[0]
    dead = session.r.backends[addr]
    session.on_response(dead, _response(rid))  # c-0 streamed a progress response
    session.on_broken(dead, "UNAVAILABLE")  # then its backend's stream broke
    client, futs = _client_with_pending(["c-0", "c-1", "c-2"])
    try:
        for resp in _drain(session.out):
            _deliver(client, resp)
        with pytest.raises(EditError) as err:
            futs["c-0"].result(0)
        assert err.value.code == "UNAVAILABLE" and "c-0" in str(err.value)
        assert not futs["c-1"].done() and not futs["c-2"].done()  # still pending: c-1 was retried elsewhere
    finally:
        client._pending.clear()
        client.close()


def test_a_backend_refusal_reaches_its_own_caller_through_the_router(session):
    """A backend's refusal ("denoise queue is full") names the router's id in its id field only, as Triton 2.51
    sends it: the router relays it with the client's id in the text."""
    for i in range(2):
        session.submit(service_pb2.ModelInferRequest(model_name="edit", id=f"c-{i}"))
    addr, rid = _Stream.sent[1]
    full = "in ensemble 'edit', RESOURCE_EXHAUSTED: denoise queue is full (1 waiting); retry later"
    session.on_response(session.r.backends[addr], _response(rid, full, final=True))
    other, again = _Stream.sent[2]  # tried on the other backend first (test_refused_elsewhere.py): full there too
    assert again == rid and other != addr
    session.on_response(session.r.backends[other], _response(rid, full, final=True))
    client, futs = _client_with_pending(["c-0", "c-1"])
    try:
        for resp in _drain(session.out):
            _deliver(client, resp)
        with pytest.raises(EditError) as err:
            futs["c-1"].result(0)
        assert err.value.code == "RESOURCE_EXHAUSTED" and not futs["c-0"].done()
        assert rid not in str(err.value)  # the router's own id does not leak out
    finally:
        client._pending.clear()
        client.close()


def test_a_broken_stream_fails_every_pending_request_of_the_client():
    """The endpoint itself went away (the router restarted): tritonclient reports one error with a status for the
    whole stream; every pending request ends with it, none waits forever."""
    client, futs = _client_with_pending(["c-0", "c-1", "c-2"])
    try:
        client._on_response(None, InferenceServerException(msg="Socket closed", status="StatusCode.UNAVAILABLE"))
        for f in futs.values():
            with pytest.raises(EditError) as err:
                f.result(0)
            assert err.value.code == "UNAVAILABLE"
        assert client._pending == {} and client._stream_broken
    finally:
        client.close()

