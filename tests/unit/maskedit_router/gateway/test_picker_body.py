"""The endpoint picker's reading of bodies, the ext_proc fields on the wire, and DNS discovery (no server)."""

import base64
import json
import struct

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from tritonclient.grpc import service_pb2

from maskedit import samples
from maskedit_router.gateway import picker_body
from maskedit_router.gateway.extproc_wire import (metadata_context, read_streamed_body, streamed_body,
                                                  with_metadata_context)
from maskedit_router.gateway.picker import subset
from maskedit_router.proxy import discovery
from tests.conftest import png

TPL, MASK = png(samples.template(256, 256, seed=1)), png(samples.mask(256, 256, 0.25, "box", seed=1))
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def _grpc_body(steps=4, loras=None, strength=None, crop=None) -> bytes:
    req = service_pb2.ModelInferRequest(model_name="edit")
    for name, value in (("TEMPLATE", TPL), ("MASK", MASK), ("PROMPT", b"a hat")) + ((("LORAS", loras),) if loras
                                                                                       else ()):
        req.inputs.add(name=name, datatype="BYTES", shape=[1]).contents.bytes_contents.append(value)
    req.inputs.add(name="STEPS", datatype="INT32", shape=[1]).contents.int_contents.append(steps)
    if strength is not None:
        req.inputs.add(name="STRENGTH", datatype="FP64", shape=[1]).contents.fp64_contents.append(strength)
    if crop is not None:
        req.inputs.add(name="PADDING_MASK_CROP", datatype="INT32", shape=[1]).contents.int_contents.append(crop)
    msg = req.SerializeToString()
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def test_json_and_grpc_bodies_of_one_edit_have_the_same_features():
    g = picker_body.grpc_features(STREAM, picker_body.first_grpc_message(_grpc_body()), 256)
    doc = {"TEMPLATE": base64.b64encode(TPL).decode(), "MASK": base64.b64encode(MASK).decode(), "PROMPT": "a hat",
           "STEPS": 4}
    j = picker_body.json_features("/v2/models/edit/generate", json.dumps(doc).encode(), 256)
    assert g == j and g.template_key and g.steps == 4 and 0.2 < g.mask_ratio < 0.35
    assert picker_body.json_features("/v2/models/edit/generate", json.dumps({**doc, "STEPS": 5}).encode(),
                                     256).template_key != g.template_key  # steps key the cache
    # the stock pipelines' parameters read alike from both
    g = picker_body.grpc_features(STREAM, picker_body.first_grpc_message(_grpc_body(strength=0.5, crop=8)), 256)
    j = picker_body.json_features("/v2/models/edit/generate", json.dumps(
        {**doc, "STRENGTH": 0.5, "PADDING_MASK_CROP": 8}).encode(), 256)
    assert g == j and g.strength == 0.5 and g.run_steps == 2 and g.mask_ratio > 0.5  # the crop's grid


def test_the_picker_and_the_router_read_the_adapters_a_request_names():
    loras = '[{"name": "attn-r4", "scale": 0.8}, {"name": "attn-mlp-r16"}]'
    g = picker_body.grpc_features(STREAM, picker_body.first_grpc_message(_grpc_body(loras=loras.encode())), 256)
    assert g.adapters == ("attn-r4", "attn-mlp-r16") and g.loras == 2
    doc = {"TEMPLATE": base64.b64encode(TPL).decode(), "MASK": base64.b64encode(MASK).decode(), "PROMPT": "a hat",
           "STEPS": 4, "LORAS": loras}
    assert picker_body.json_features("/v2/models/edit/generate", json.dumps(doc).encode(), 256) == g
    # malformed: no adapters to route by (the backend refuses it, naming LORAS)
    bad = picker_body.grpc_features(STREAM, picker_body.first_grpc_message(_grpc_body(loras=b"[{")), 256)
    assert bad.adapters == () and bad.template_key == g.template_key


def test_grpc_message_is_read_once_whole():
    data = _grpc_body()
    assert picker_body.first_grpc_message(data[:4]) is None and picker_body.first_grpc_message(data[:-1]) is None
    assert picker_body.first_grpc_message(data + b"\x00next") == data[5:]
    with pytest.raises(picker_body.BadBody, match="compressed"):
        picker_body.first_grpc_message(b"\x01" + data[1:])
    with pytest.raises(picker_body.BadBody, match="ModelInferRequest"):
        picker_body.grpc_features(STREAM, b"\xff\xff\xff", 256)


@pytest.mark.parametrize("data", [b"{", b"[]", b"\xff\xfe"])
def test_bad_json_is_bad_body(data):
    with pytest.raises(picker_body.BadBody):
        picker_body.json_features("/v2/models/edit/generate", data, 256)


def test_calls_that_run_no_edit_cost_nothing():
    assert picker_body.json_features("/v2/health/ready", b"", 256) == picker_body.NO_WORK
    assert picker_body.json_features("/v2/models/cancel/generate", b"{}", 256) == picker_body.NO_WORK
    assert picker_body.grpc_features("/inference.GRPCInferenceService/ServerReady", b"", 256) == picker_body.NO_WORK


def test_subset_and_streamed_body_survive_the_wire():
    md = base_pb2.Metadata()
    md.filter_metadata["envoy.lb.subset_hint"].update({"x-gateway-destination-endpoint-subset": ["10.0.0.1:8001"]})
    req = with_metadata_context(ep.ProcessingRequest(request_headers=ep.HttpHeaders()), md)
    again = ep.ProcessingRequest.FromString(req.SerializeToString())
    assert metadata_context(again) == md and subset(again) == ["10.0.0.1:8001"]
    assert subset(ep.ProcessingRequest(request_headers=ep.HttpHeaders())) is None
    resp = ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=streamed_body(b"x" * 300, True))))
    assert read_streamed_body(ep.ProcessingResponse.FromString(resp.SerializeToString())
                              .request_body.response.body_mutation) == (b"x" * 300, True)
    assert read_streamed_body(streamed_body(b"", False)) == (b"", False)
    assert read_streamed_body(ep.BodyMutation(body=b"x")) is None


def test_dns_discovery_lists_every_address():
    assert "127.0.0.1:8001" in discovery.from_dns("localhost:8001")
    assert discovery.from_dns("no-such-host.invalid:8001") == []
    assert discovery.from_list("a:1, b:2\nc:3") == ["a:1", "b:2", "c:3"]


def test_picker_names_the_pools_target_port_for_each_protocol_and_matches_the_subset_on_it():
    """The picker's protocol logic, called directly (the integration test runs it over gRPC)."""
    from maskedit_router.__main__ import build
    from maskedit_router.gateway.picker import EndpointPicker

    router = build(["10.0.0.1:8001", "10.0.0.2:8001"], resolution=256)
    picker = EndpointPicker(router, target_port=8001, http_target_port=8000)
    doc = json.dumps({"TEMPLATE": base64.b64encode(TPL).decode(), "MASK": base64.b64encode(MASK).decode()}).encode()

    def run(content_type, data, offered=None):
        hs = ep.HttpHeaders()
        for k, v in ((":path", "/v2/models/edit/generate"), ("content-type", content_type)):
            hs.headers.headers.add(key=k, raw_value=v.encode())
        req = ep.ProcessingRequest(request_headers=hs)
        if offered is not None:
            md = base_pb2.Metadata()
            md.filter_metadata["envoy.lb.subset_hint"].update({"x-gateway-destination-endpoint-subset": offered})
            req = with_metadata_context(req, md)
        out = list(picker.Process(iter([req, ep.ProcessingRequest(request_body=ep.HttpBody(body=data,
                                                                                             end_of_stream=True))]),
                                  None))
        if out[0].WhichOneof("response") == "immediate_response":
            return out[0].immediate_response.status.code
        return out[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value

    first = run("application/json", doc)
    assert first in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert run("application/json", doc) == first  # affinity
    other = "10.0.0.2:8000" if first == "10.0.0.1:8000" else "10.0.0.1:8000"
    assert run("application/json", doc, [other]) == other
    assert run("application/json", doc, [other.replace(":8000", ":8001")]) == 503  # the gRPC port is not offered
    assert run("application/grpc", _grpc_body(), [other.replace(":8000", ":8001")]) == \
        other.replace(":8000", ":8001")
    assert all(b.load.inflight == 0 for b in router.backends.values())
    for b in router.backends.values():
        b.close()


def test_a_grpc_stream_is_placed_at_its_first_message_without_waiting_for_its_end():
    """A model stream stays open for more requests: the picker answers once the first message is whole, and later
    chunks pass through as they come."""
    import queue

    from maskedit_router.__main__ import build
    from maskedit_router.gateway.picker import EndpointPicker

    router = build(["10.0.0.1:8001", "10.0.0.2:8001"], resolution=256)
    picker = EndpointPicker(router)
    hs = ep.HttpHeaders()
    for k, v in ((":path", STREAM), ("content-type", "application/grpc")):
        hs.headers.headers.add(key=k, raw_value=v.encode())
    first, second = _grpc_body(4), _grpc_body(5)
    q = queue.Queue()
    answers = picker.Process(iter(q.get, None), None)
    q.put(ep.ProcessingRequest(request_headers=hs))
    q.put(ep.ProcessingRequest(request_body=ep.HttpBody(body=first[:100])))
    q.put(ep.ProcessingRequest(request_body=ep.HttpBody(body=first[100:] + second[:10])))  # no end of stream
    assert next(answers).request_headers.response.header_mutation.set_headers[0].header.raw_value.startswith(b"10.")
    assert read_streamed_body(next(answers).request_body.response.body_mutation) == (first + second[:10], False)
    assert sum(b.load.inflight for b in router.backends.values()) == 1  # booked while the stream lives
    q.put(ep.ProcessingRequest(request_body=ep.HttpBody(body=second[10:], end_of_stream=True)))
    assert read_streamed_body(next(answers).request_body.response.body_mutation) == (second[10:], True)
    q.put(None)
    assert list(answers) == []
    assert sum(b.load.inflight for b in router.backends.values()) == 0  # and released when it ends
    for b in router.backends.values():
        b.close()


def test_the_router_reads_adapter_names_from_raw_grpc_contents_as_the_client_sends_them():
    from maskedit_router.placement.features import adapter_names

    req = service_pb2.ModelInferRequest(model_name="edit")
    for name, value in (("PROMPT", b"a hat"), ("LORAS", b'{"name": "attn-r4", "scale": 0.5}')):
        req.inputs.add(name=name, datatype="BYTES", shape=[1])
        req.raw_input_contents.append(struct.pack("<I", len(value)) + value)
    assert adapter_names(req) == ("attn-r4",)
    req.raw_input_contents[1] = struct.pack("<I", 2) + b"[{"  # malformed: none (the backend refuses it)
    assert adapter_names(req) == ()
    del req.inputs[1]
    del req.raw_input_contents[1]
    assert adapter_names(req) == ()
