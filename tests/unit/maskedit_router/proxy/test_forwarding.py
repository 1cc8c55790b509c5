"""A client's stream request is forwarded itself, not a copy (a 512² edit is ~0.4 MB): renamed to a router-unique
id and asked for its empty final response, while the client gets its own id and only the final responses it asked
for. Reading its routing features is timed (``maskedit_router_features_seconds``)."""

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request

from maskedit_client.inputs import edit_inputs
from maskedit_router.proxy import stream_session
from tests.conftest import png

from .test_server_faults import _Stream, session  # noqa: F401 (the fixture)


def _edit(client_id: str, want_final: bool):
    mask = np.zeros((64, 64), np.uint8)
    mask[:32] = 255
    inputs = edit_inputs(png(np.full((64, 64, 3), 128, np.uint8)), png(mask), "a hat", steps=4)
    req = _get_inference_request("edit", inputs, "", client_id, None, 0, False, False, 0, None, None)
    if want_final:
        req.parameters[stream_session.EMPTY_FINAL].bool_param = True
    return req


@pytest.mark.parametrize("want_final", [False, True])
def test_the_request_itself_is_forwarded_renamed_and_the_client_gets_its_own_id(session, want_final):
    req = _edit("mine", want_final)
    session.submit(req)
    (addr, rid), = _Stream.sent
    assert req.id == rid != "mine"  # the client's own message was renamed and sent: no copy
    assert req.parameters[stream_session.EMPTY_FINAL].bool_param
    read = session.r.metrics.registry.get_sample_value
    assert read("maskedit_router_features_seconds_count") == 1 and read("maskedit_router_features_seconds_sum") > 0
    p = session.pending[rid]
    assert p.request is req and p.ticket.features.mask_ratio == pytest.approx(0.5) and p.ticket.features.steps == 4
    final = service_pb2.ModelStreamInferResponse()  # the backend's empty final response
    final.infer_response.id = rid
    final.infer_response.parameters[stream_session.FINAL].bool_param = True
    session.on_response(session.r.backends[addr], final)
    out = [] if session.out.empty() else [session.out.get_nowait()]
    assert [r.infer_response.id for r in out] == (["mine"] if want_final else [])
    assert not session.pending


def test_a_mask_sent_again_is_counted_as_remembered(session):
    """``maskedit_router_mask_ratio_lookups_total``: a mask the router measured before is a hit (no decode)."""
    read = session.r.metrics.registry.get_sample_value
    mask = np.zeros((64, 64), np.uint8)
    mask[:5, :7] = 255  # a mask no other test sends
    before = {r: read("maskedit_router_mask_ratio_lookups_total", {"result": r}) for r in ("hit", "miss")}
    for i in range(2):
        inputs = edit_inputs(png(np.full((64, 64, 3), 128, np.uint8)), png(mask), "a hat", steps=4)
        session.submit(_get_inference_request("edit", inputs, "", f"again{i}", None, 0, False, False, 0, None, None))
    after = {r: read("maskedit_router_mask_ratio_lookups_total", {"result": r}) for r in ("hit", "miss")}
    assert (after["miss"] - before["miss"], after["hit"] - before["hit"]) == (1, 1)
