"""The router as a GIE endpoint picker: the test plays the gateway's side of Envoy's ext_proc stream against the
real picker (gRPC), in front of two real Triton instances, and sends each edit on to the pod it picked (with the
picker's header mutations applied as Envoy applies them, where a test needs them)."""

import base64
import json
import queue
import struct
import time

import grpc
import numpy as np
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from tritonclient.grpc import service_pb2

from maskedit import samples
from maskedit_client import EditClient
from maskedit_lab.harness.cluster import running_cluster
from maskedit_router.gateway.extproc_wire import read_streamed_body, with_metadata_context
from maskedit_router.gateway.picker import EndpointPicker, serve_picker
from tests.conftest import png
from tests.envoy_headers import apply_header_mutation

STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


@pytest.fixture(scope="module")
def pool(settings, tmp_path_factory):
    with running_cluster(2, tmp_path_factory.mktemp("picker"), env={"MASKEDIT_MODEL_DIR": str(settings.model_dir)},
                         health={"interval_s": 0.5, "probe_every_s": 2.0, "probe_timeout_s": 5.0}) as (router, _,
                                                                                                        servers):
        server, port = serve_picker(EndpointPicker(router), 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        check = channel.unary_unary("/grpc.health.v1.Health/Check")  # raw bytes in and out
        try:
            yield {"router": router, "servers": servers, "stub": ep_grpc.ExternalProcessorStub(channel),
                   "health": lambda service: check(b"\x0a" + bytes([len(service)]) + service.encode(), timeout=5)}
        finally:
            channel.close()
            server.stop(grace=1).wait(10)


class Proxy:
    """One ext_proc stream, the gateway's side: send phases, read the picker's answers."""

    def __init__(self, stub):
        self.q: queue.Queue = queue.Queue()
        self.answers = stub.Process(iter(self.q.get, None), timeout=60)

    def send(self, req) -> None:
        self.q.put(req)

    def recv(self):
        return next(self.answers)

    def close(self) -> list:
        self.q.put(None)
        return list(self.answers)


def headers(path, content_type="application/grpc", end_of_stream=False, offered=None, method="POST", extra=()):
    hs = ep.HttpHeaders(end_of_stream=end_of_stream)
    for k, v in ((":path", path), (":method", method), ("content-type", content_type), *extra):
        hs.headers.headers.add(key=k, raw_value=v.encode())
    req = ep.ProcessingRequest(request_headers=hs)
    if offered is not None:
        md = base_pb2.Metadata()
        md.filter_metadata["envoy.lb.subset_hint"].update({"x-gateway-destination-endpoint-subset": offered})
        req = with_metadata_context(req, md)
    return req


def body(data: bytes, end_of_stream: bool):
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end_of_stream))


def edit_message(tpl, mask, steps=2, loras: bytes | None = None) -> bytes:
    req = service_pb2.ModelInferRequest(model_name="edit", id="1")
    for name, value in (("TEMPLATE", png(tpl)), ("MASK", png(mask)), ("PROMPT", b"a hat")) + (
            (("LORAS", loras),) if loras else ()):
        req.inputs.add(name=name, datatype="BYTES", shape=[1]).contents.bytes_contents.append(value)
    req.inputs.add(name="STEPS", datatype="INT32", shape=[1]).contents.int_contents.append(steps)
    msg = req.SerializeToString()
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def picked(answer) -> str:
    """The endpoint of a request-headers answer, checked to be the same in the header and the metadata."""
    assert answer.WhichOneof("response") == "request_headers", answer
    common = answer.request_headers.response
    hdr = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert common.clear_route_cache and hdr["x-gateway-destination-endpoint"] == lb.string_value
    return lb.string_value


def finish(proxy: Proxy, status=200) -> None:
    """The upstream answered: response phases pass through, then the stream ends."""
    rh = ep.HttpHeaders()
    rh.headers.headers.add(key=":status", raw_value=str(status).encode())
    proxy.send(ep.ProcessingRequest(response_headers=rh))
    assert proxy.recv().WhichOneof("response") == "response_headers"
    proxy.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"done", end_of_stream=True)))
    assert read_streamed_body(proxy.recv().response_body.response.body_mutation) == (b"done", True)
    assert proxy.close() == []


def exchange(pool, data: bytes, offered=None, path=STREAM_PATH, content_type="application/grpc", stub=None,
             extra=(), answers=None):
    """Headers and the body in two chunks; returns (proxy, endpoint) after checking the body came back whole.
    ``answers``: a list that gets the headers answer and the body that came back (which then may differ)."""
    p = Proxy(stub or pool["stub"])
    p.send(headers(path, content_type, offered=offered, extra=extra))
    p.send(body(data[:7], False))  # not yet a whole message: the picker waits for more
    p.send(body(data[7:], True))
    answer = p.recv()
    endpoint = picked(answer)
    echoed = read_streamed_body(p.recv().request_body.response.body_mutation)
    if answers is None:
        assert echoed == (data, True)
    else:
        answers += [answer, echoed[0]]
    return p, endpoint


def immediate(answers) -> ep.ImmediateResponse:
    assert len(answers) == 1 and answers[0].WhichOneof("response") == "immediate_response", answers
    return answers[0].immediate_response


def test_pick_then_the_edit_runs_on_that_pod_and_its_template_stays_there(pool):
    tpl, mask = samples.template(256, 256, seed=70), samples.mask(256, 256, 0.2, "box", seed=1)
    outcomes, endpoints = [], []
    for i in range(3):
        p, endpoint = exchange(pool, edit_message(tpl, mask))
        assert endpoint in pool["router"].backends
        with EditClient(endpoint) as c:  # the gateway sends the request to the pod we named
            outcomes.append(c.edit(tpl, samples.mask(256, 256, 0.2, "box", seed=i), "a hat", steps=2).info["cache"])
        finish(p)
        endpoints.append(endpoint)
        time.sleep(0.3)  # the recording is written right after the first answer
    assert len(set(endpoints)) == 1, endpoints  # cache affinity
    assert outcomes[0] == "record" and outcomes[1:] == ["hit", "hit"], outcomes
    assert all(b.load.inflight == 0 for b in pool["router"].backends.values())  # every booking ended


def test_json_generate_body_is_picked_at_its_end_and_bodiless_requests_at_their_headers(pool):
    tpl, mask = samples.template(256, 256, seed=71), samples.mask(256, 256, 0.1, "box", seed=2)
    doc = json.dumps({"TEMPLATE": base64.b64encode(png(tpl)).decode(), "MASK": base64.b64encode(png(mask)).decode(),
                      "PROMPT": "a hat", "STEPS": 2}).encode()
    p, endpoint = exchange(pool, doc, path="/v2/models/edit/generate", content_type="application/json")
    finish(p)
    assert endpoint in pool["router"].backends
    p = Proxy(pool["stub"])
    p.send(headers("/v2/health/ready", "", end_of_stream=True, method="GET"))
    assert picked(p.recv()) in pool["router"].backends
    finish(p)


def test_the_picker_sees_a_requests_adapters_and_sends_the_next_request_naming_them_to_the_same_pod(pool):
    """The picker reads ``LORAS`` from the body and books the adapters on the chosen pod (the router's shadow); a
    later request with another template but the same adapter goes where it is loaded (its cold load saved), each
    adapter to its own pod, whichever way the pods' other ties would break."""
    mask = samples.mask(256, 256, 0.2, "box", seed=4)
    tpl = lambda seed: samples.template(256, 256, seed=seed)  # noqa: E731  (a fresh template: no cache affinity)
    r4, r8 = b'[{"name": "attn-r4", "scale": 0.7}]', b'[{"name": "attn-mlp-r8"}]'
    p1, x = exchange(pool, edit_message(tpl(75), mask, loras=r4))
    p2, y = exchange(pool, edit_message(tpl(76), mask, loras=r8))  # x is busy with the first: the other pod
    finish(p1)
    finish(p2)  # (a gRPC stream's lifetime does not refit the cost model)
    assert x != y
    now = time.monotonic()
    books = {a: b.load.adapters for a, b in pool["router"].backends.items()}
    assert books[x].holds("attn-r4", now) and books[y].holds("attn-mlp-r8", now)
    assert not books[x].holds("attn-mlp-r8", now) and not books[y].holds("attn-r4", now)
    for seed, loras, holder in ((77, r8, y), (78, r4, x), (79, r8, y)):
        p, again = exchange(pool, edit_message(tpl(seed), mask, loras=loras))
        finish(p)
        assert again == holder, (seed, loras)


def test_only_endpoints_of_the_offered_subset_are_picked(pool):
    tpl, mask = samples.template(256, 256, seed=72), samples.mask(256, 256, 0.2, "box", seed=3)
    p, first = exchange(pool, edit_message(tpl, mask))
    finish(p)
    other = next(a for a in pool["router"].backends if a != first)
    for _ in range(2):  # affinity would pick `first`; the proxy offers only `other`
        p, endpoint = exchange(pool, edit_message(tpl, mask), offered=[other])
        finish(p)
        assert endpoint == other
    p, endpoint = exchange(pool, edit_message(tpl, mask), offered=[first, "10.255.255.1:8001"])
    finish(p)
    assert endpoint == first


@pytest.mark.parametrize("offered", [["10.255.255.1:8001"], []])
def test_no_eligible_endpoint_in_the_subset_is_an_immediate_503(pool, offered):
    p = Proxy(pool["stub"])
    p.send(headers(STREAM_PATH, offered=offered))
    p.send(body(edit_message(samples.template(64, 64), np.zeros((64, 64), np.uint8)), True))
    imm = immediate(p.close())
    assert imm.status.code == 503 and imm.grpc_status.status == 14  # UNAVAILABLE for a gRPC client


def test_no_healthy_endpoint_is_503_and_full_is_429(pool):
    router = pool["router"]
    doc = json.dumps({"PROMPT": "x"}).encode()
    serving, not_serving = b"\x08\x01", b"\x08\x02"  # grpc.health.v1 HealthCheckResponse.status
    assert pool["health"]("readiness") == serving and pool["health"]("envoy.service.ext_proc.v3.ExternalProcessor") \
        == serving
    for b in router.backends.values():  # circuit breakers open and held open (a probe would close them)
        b.open_circuit()
        b.succeeded = lambda: None
    try:
        assert pool["health"]("readiness") == not_serving and pool["health"]("liveness") == serving
        p = Proxy(pool["stub"])
        p.send(headers("/v2/models/edit/generate", "application/json"))
        p.send(body(doc, True))
        imm = immediate(p.close())
        assert imm.status.code == 503 and "no healthy backend" in json.loads(imm.body)["error"]["message"]
    finally:
        for b in router.backends.values():
            del b.succeeded
            b.succeeded()
    limit, router.max_inflight = router.max_inflight, 0
    try:
        p = Proxy(pool["stub"])
        p.send(headers("/v2/models/edit/generate", "application/json"))
        p.send(body(doc, True))
        assert immediate(p.close()).status.code == 429
    finally:
        router.max_inflight = limit


@pytest.mark.parametrize("content_type,data,grpc_code", [
    ("application/json", b'{"TEMPLATE": "abc", ', None),
    ("application/json", b"[1, 2]", None),
    ("application/grpc", b"\x00\x00\x00\x00\x05\xff\xff\xff\xff\xff", 3),
    ("application/grpc", b"\x01\x00\x00\x00\x01\x00", 3),  # compressed
    ("application/grpc", b"\x00\x00\x00\x10", 3),  # ends inside its first message
])
def test_malformed_body_is_an_immediate_400_and_the_picker_keeps_serving(pool, content_type, data, grpc_code):
    path = STREAM_PATH if grpc_code else "/v2/models/edit/generate"
    p = Proxy(pool["stub"])
    p.send(headers(path, content_type))
    p.send(body(data, True))
    imm = immediate(p.close())
    assert imm.status.code == 400 and imm.details
    if grpc_code:
        assert imm.grpc_status.status == grpc_code
    else:
        assert json.loads(imm.body)["error"]["type"] == "invalid_request_error"
    p, _ = exchange(pool, edit_message(samples.template(64, 64), np.zeros((64, 64), np.uint8)))
    finish(p)


def test_a_pod_removed_mid_run_is_no_longer_picked(pool):
    router = pool["router"]
    everyone = list(router.backends)
    tpl, mask = samples.template(256, 256, seed=73), samples.mask(256, 256, 0.2, "box", seed=4)
    p, gone = exchange(pool, edit_message(tpl, mask))
    survivor = next(a for a in everyone if a != gone)
    router.set_backends([survivor])  # the pod left the pool while its request was in flight
    try:
        finish(p)  # that exchange still ends cleanly
        for i in range(2):  # the template's pod is gone: its edits go to the survivor, and run there
            p, endpoint = exchange(pool, edit_message(tpl, mask))
            assert endpoint == survivor
            with EditClient(endpoint) as c:
                assert c.edit(tpl, mask, "a hat", steps=2).image.size == (256, 256)
            finish(p)
        p = Proxy(pool["stub"])  # and a subset naming only the removed pod has nothing eligible
        p.send(headers(STREAM_PATH, offered=[gone]))
        p.send(body(edit_message(tpl, mask), True))
        assert immediate(p.close()).status.code == 503
    finally:
        router.set_backends(everyone)


KEY = "sk-acme-0123456789abcdef"
FORGED = (("x-maskedit-tenant", "vip"), ("x-maskedit-tenant-weight", "100"))


@pytest.fixture(scope="module")
def keyed(pool, tmp_path_factory):
    """A second picker with API keys over the same router and pods (a picker is a gRPC service: no new Triton)."""
    from maskedit_router.access.auth import Keyring

    keys = tmp_path_factory.mktemp("picker-keys") / "keys.txt"
    keys.write_text(f"{KEY} acme user weight=2.5\n")
    server, port = serve_picker(EndpointPicker(pool["router"], keyring=Keyring(keys)), 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield ep_grpc.ExternalProcessorStub(channel)
    finally:
        channel.close()
        server.stop(grace=1).wait(10)


def _stream_edit(url, tpl, mask, headers, parameters=None):
    """One edit over Triton's own gRPC stream with these headers (as the gateway sends it on): (EDIT_INFO, error)."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in (("TEMPLATE", png(tpl)), ("MASK", png(mask)), ("PROMPT", b"a hat")):
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value], dtype=object))
        inputs.append(t)
    steps = grpcclient.InferInput("STEPS", [1], "INT32")
    steps.set_data_from_numpy(np.array([1], np.int32))
    got: queue.Queue = queue.Queue()
    tc = grpcclient.InferenceServerClient(url)
    try:
        tc.start_stream(lambda result, error: got.put((result, error)), headers=dict(headers))
        tc.async_stream_infer("edit", inputs + [steps], parameters=parameters)
        result, error = got.get(timeout=120)
        tc.stop_stream()
    finally:
        tc.close()
    return (None if result is None else json.loads(result.as_numpy("EDIT_INFO").reshape(-1)[0])), error


def test_through_the_picker_the_pod_learns_the_keys_tenant_never_the_clients(pool, keyed):
    """The client sends its key and forged tenant headers (and the router's parameter names in the body); the
    picker's mutation, applied as Envoy applies it, leaves the key's tenant, which Triton forwards to the backend's
    fair share (EDIT_INFO reports what it queued the edit under). Controls: the same headers unmutated do reach the
    backend (so the check is not vacuous), and a parameter named as the header is refused, naming it."""
    tpl, mask = samples.template(256, 256, seed=80), samples.mask(256, 256, 0.2, "box", seed=5)
    sent = (("authorization", f"Bearer {KEY}"), *FORGED)
    claimed = {"maskedit_tenant": "vip", "maskedit_tenant_weight": 50.0}
    answers: list = []
    p, endpoint = exchange(pool, edit_message(tpl, mask), stub=keyed, extra=sent, answers=answers)
    onward = apply_header_mutation([(":path", STREAM_PATH), *sent],
                                   answers[0].request_headers.response.header_mutation)
    onward = [(k, v) for k, v in onward if not k.startswith(":") and k != "x-gateway-destination-endpoint"]
    assert sorted(onward) == [("x-maskedit-tenant", "acme"), ("x-maskedit-tenant-weight", "2.5")]
    info, err = _stream_edit(endpoint, tpl, mask, onward, claimed)
    finish(p)
    assert err is None, err
    assert (info["tenant"], info["tenant_weight"]) == ("acme", 2.5)
    forged, err = _stream_edit(endpoint, tpl, mask, FORGED)  # had the gateway not applied the mutation
    assert err is None and (forged["tenant"], forged["tenant_weight"]) == ("vip", 100.0), err
    _, err = _stream_edit(endpoint, tpl, mask, onward, {"x-maskedit-tenant-weight": "100"})
    assert "x-maskedit-tenant-weight: is reserved for the gateway's header" in str(err), err


def test_through_the_picker_a_generate_body_names_the_keys_tenant(pool, keyed):
    """Triton forwards no headers to ``/generate``: the picker writes the tenant into the JSON body instead."""
    import urllib.request

    tpl, mask = samples.template(256, 256, seed=81), samples.mask(256, 256, 0.1, "box", seed=6)
    doc = json.dumps({"TEMPLATE": base64.b64encode(png(tpl)).decode(), "MASK": base64.b64encode(png(mask)).decode(),
                      "PROMPT": "a hat", "STEPS": 1, "x-maskedit-tenant": "vip"}).encode()
    answers: list = []
    path = "/v2/models/edit/generate"
    p, endpoint = exchange(pool, doc, path=path, content_type="application/json", stub=keyed,
                           extra=(("authorization", f"Bearer {KEY}"),), answers=answers)
    onward = dict(apply_header_mutation([("content-length", str(len(doc)))],
                                        answers[0].request_headers.response.header_mutation))
    assert onward["content-length"] == str(len(answers[1]))
    http = next(s.http_url for s in pool["servers"] if s.grpc_url == endpoint)  # the pod's HTTP port

    def generate(data: bytes, headers: dict):
        req = urllib.request.Request(f"http://{http}{path}", data=data, method="POST",
                                     headers={"content-type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=120) as r:
            info = json.loads(r.read())["EDIT_INFO"]
        info = json.loads(info) if isinstance(info, str) else info
        return info["tenant"], info["tenant_weight"]

    tenant_headers = {k: v for k, v in onward.items() if k.startswith("x-maskedit-tenant")}
    assert generate(answers[1], tenant_headers) == ("acme", 2.5)
    # control: the picker's headers alone, on the body as the client sent it, do not reach the backend (Triton
    # forwards no headers to /generate): the client's key in the body would win, hence the rewrite
    assert generate(doc, tenant_headers) == ("vip", 1.0)
    finish(p)


def test_the_router_command_serves_the_picker_with_dns_discovery(tmp_path):
    """`maskedit-router --backends-dns ... --ext-proc-port ...` as the picker Deployment runs it: the name resolves to
    an address where no Triton answers, so the picker is live and not ready, and an edit gets an immediate 503."""
    import json as _json
    import signal
    import subprocess
    import sys

    from maskedit.launcher import free_port

    ports = [free_port() for _ in range(3)]
    dead = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "maskedit_router", "--backends-dns", f"localhost:{dead}",
                             "--port", str(ports[0]), "--http-port", str(ports[1]), "--openai-port", "0",
                             "--ext-proc-port", str(ports[2]), "--target-port", "8001"],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "router.log", "w"), text=True)
    try:
        started = _json.loads(proc.stdout.readline())
        assert started["ext_proc"] == ports[2] and started["backends"] == [f"127.0.0.1:{dead}"]
        assert started["gc_frozen_objects"] > 10_000  # what the start built is out of the collector's walks
        channel = grpc.insecure_channel(f"127.0.0.1:{ports[2]}")
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"\x0a\x08liveness", timeout=5) == b"\x08\x01"
        deadline = time.time() + 30
        while check(b"\x0a\x09readiness", timeout=5) != b"\x08\x02" and time.time() < deadline:
            time.sleep(0.5)  # the health checker finds nothing answering there
        assert check(b"\x0a\x09readiness", timeout=5) == b"\x08\x02"
        p = Proxy(ep_grpc.ExternalProcessorStub(channel))
        p.send(headers(STREAM_PATH))
        p.send(body(edit_message(samples.template(64, 64), np.zeros((64, 64), np.uint8)), True))
        assert immediate(p.close()).status.code == 503
        channel.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, (tmp_path / "router.log").read_text()[-2000:]
