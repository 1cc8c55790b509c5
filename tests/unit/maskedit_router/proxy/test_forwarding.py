"""A client's stream request is forwarded itself, not a copy (a 512² edit is ~0.4 MB): renamed to a router-unique
id and asked for its empty final response, while the client gets its own id and only the final responses it asked
for. Reading its routing features is timed (``maskedit_router_features_seconds``)."""

from types import SimpleNamespace

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request

from maskedit_client.inputs import edit_inputs
from maskedit_common.cost_model import CostModel
from maskedit_router.placement.policies import Estimator, make
from maskedit_router.proxy import server, stream_session
from tests.conftest import png


class _Stream:
    sent: list = []

    def __init__(self, session, backend):
        self.backend, self.broken = backend, False

    def send(self, req):
        self.sent.append((self.backend, req))

    def cancel(self):
        pass

    def close(self):
        pass


@pytest.fixture
def session(monkeypatch):
    monkeypatch.setattr(stream_session, "_BackendStream", _Stream)
    monkeypatch.setattr(_Stream, "sent", [])
    est = Estimator(CostModel.fallback())
    router = server.Router(["a:1"], make("round_robin", est), est, admission_wait_s=0)
    yield stream_session._StreamSession(router, SimpleNamespace(add_callback=lambda cb: None,
                                                                is_active=lambda: True))
    for b in router.backends.values():
        b.close()


def _edit(client_id: str, want_final: bool):
    mask = np.zeros((64, 64), np.uint8)
    mask[:32] = 255
    inputs = edit_inputs(png(np.full((64, 64, 3), 128, np.uint8)), png(mask), "a hat", steps=4)
    req = _get_inference_request("edit", inputs, "", client_id, None, 0, False, False, 0, None, None)
    if want_final:
        req.parameters[stream_session.EMPTY_FINAL].bool_param = True
    return req


def _final(rid: str):
    resp = service_pb2.ModelStreamInferResponse()
    resp.infer_response.id = rid
    resp.infer_response.parameters[server.FINAL].bool_param = True
    return resp


@pytest.mark.parametrize("want_final", [False, True])
def test_the_request_itself_is_forwarded_renamed_and_the_client_gets_its_own_id(session, want_final):
    req = _edit("mine", want_final)
    session.submit(req)
    (backend, fwd), = _Stream.sent
    assert fwd is req  # no copy
    assert fwd.id != "mine" and fwd.parameters[stream_session.EMPTY_FINAL].bool_param
    read = session.r.metrics.registry.get_sample_value
    assert read("maskedit_router_features_seconds_count") == 1 and read("maskedit_router_features_seconds_sum") > 0
    p = session.pending[fwd.id]
    assert p.ticket.features.mask_ratio == pytest.approx(0.5) and p.ticket.features.steps == 4
    session.on_response(backend, _final(fwd.id))  # the backend's empty final response
    out = [] if session.out.empty() else [session.out.get_nowait()]
    assert [r.infer_response.id for r in out] == (["mine"] if want_final else [])
    assert not session.pending
