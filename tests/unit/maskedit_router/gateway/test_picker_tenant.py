"""The endpoint picker names the key's tenant to the pod (no server): its header mutation, applied as Envoy applies
it, leaves the key's tenant and weight and none of the client's forged copies; a generate body gets the same; the
backend reads them as Triton forwards them (``maskedit.fair_share.tenant_of``); every Triton we start forwards them."""

import base64
import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from maskedit import samples
from maskedit.errors import InvalidInput
from maskedit.fair_share import tenant_of
from maskedit_common.tenant_wire import FORWARD_PATTERN, TRITON_ARGS
from maskedit_router.gateway.extproc_wire import read_streamed_body
from maskedit_router.gateway.picker import EndpointPicker
from tests.conftest import REPO_ROOT, png
from tests.envoy_headers import apply_header_mutation
from tests.unit.maskedit_router.gateway.test_picker_body import STREAM, _grpc_body

KEY = "sk-acme-0123456789abcdef"
FORGED = [("x-maskedit-tenant", "vip"), ("X-Maskedit-Tenant-Weight", "100"), ("x-maskedit-tenant", "vip2")]


@pytest.fixture
def router():
    from maskedit_router.__main__ import build

    r = build(["10.0.0.1:8001", "10.0.0.2:8001"], resolution=256)
    yield r
    for b in r.backends.values():
        b.close()


def keyring(tmp_path):
    from maskedit_router.access.auth import Keyring

    path = tmp_path / "keys.txt"
    path.write_text(f"{KEY} acme user weight=2.5\n")
    return Keyring(path)


def run(picker, path, content_type, data, extra_headers=()):
    """One exchange; returns (the client's headers after the picker's mutation as Envoy applies it, the body the pod
    gets)."""
    sent = [(":path", path), ("content-type", content_type), *extra_headers]
    hs = ep.HttpHeaders()
    for k, v in sent:
        hs.headers.headers.add(key=k, raw_value=v.encode())
    out = list(picker.Process(iter([ep.ProcessingRequest(request_headers=hs), ep.ProcessingRequest(
        request_body=ep.HttpBody(body=data, end_of_stream=True))]), None))
    assert [o.WhichOneof("response") for o in out] == ["request_headers", "request_body"], out
    headers = apply_header_mutation(sent, out[0].request_headers.response.header_mutation)
    body, eos = read_streamed_body(out[1].request_body.response.body_mutation)
    assert eos
    return headers, body


def test_the_picker_sets_the_keys_tenant_and_strips_the_clients_forged_tenant_headers(router, tmp_path):
    picker = EndpointPicker(router, keyring=keyring(tmp_path))
    data = _grpc_body()
    headers, body = run(picker, STREAM, "application/grpc", data, [("authorization", f"Bearer {KEY}"), *FORGED])
    tenant = [(k, v) for k, v in headers if k.startswith("x-maskedit-tenant")]
    assert sorted(tenant) == [("x-maskedit-tenant", "acme"), ("x-maskedit-tenant-weight", "2.5")]
    assert not any(k == "authorization" for k, _ in headers)  # the key stays at the gateway
    assert body == data  # a gRPC body is never rewritten
    # Triton forwards the headers as string parameters, after the request's own: what the backend then reads
    params = "{" + ",".join(f'"{k}":"{v}"' for k, v in tenant) + "}"
    assert tenant_of(params) == ("acme", 2.5)


def test_without_the_mutation_the_forged_headers_would_win(router, tmp_path):
    """Negative control: the client's own headers, had they reached the pod, name a heavier tenant."""
    forged = '{"x-maskedit-tenant":"vip","x-maskedit-tenant-weight":"100"}'
    assert tenant_of(forged) == ("vip", 100.0)


def test_open_mode_names_no_tenant_and_still_strips_the_clients(router):
    headers, _ = run(EndpointPicker(router), STREAM, "application/grpc", _grpc_body(),
                     [("authorization", "Bearer whatever-0123456789"), *FORGED])
    assert not any(k.startswith("x-maskedit-tenant") for k, _ in headers)
    assert ("authorization", "Bearer whatever-0123456789") in headers  # open mode: the picker holds no keys


def test_a_generate_body_names_the_keys_tenant_over_the_clients_and_its_length_follows(router, tmp_path):
    picker = EndpointPicker(router, keyring=keyring(tmp_path))
    tpl, mask = png(samples.template(256, 256, seed=1)), png(samples.mask(256, 256, 0.25, "box", seed=1))
    doc = {"TEMPLATE": base64.b64encode(tpl).decode(), "MASK": base64.b64encode(mask).decode(), "PROMPT": "a hat",
           "x-maskedit-tenant": "vip", "parameters": {"x-maskedit-tenant-weight": "100", "keep": 1}}
    data = json.dumps(doc).encode()
    headers, body = run(picker, "/v2/models/edit/generate", "application/json", data,
                        [("authorization", f"Bearer {KEY}"), ("content-length", str(len(data)))])
    got = json.loads(body)
    assert (got["x-maskedit-tenant"], got["x-maskedit-tenant-weight"]) == ("acme", "2.5")
    assert got["parameters"] == {"keep": 1} and got["TEMPLATE"] == doc["TEMPLATE"]
    assert ("content-length", str(len(body))) in headers and len(body) != len(data)
    # /infer bodies are left alone: Triton forwards the headers there
    data = json.dumps({"inputs": [], "parameters": {"x-maskedit-tenant": "vip"}}).encode()
    _, body = run(picker, "/v2/models/edit/infer", "application/json", data, [("authorization", f"Bearer {KEY}")])
    assert body == data


def test_the_backend_reads_the_forwarded_headers_over_the_routers_names_and_refuses_a_name_sent_twice():
    # the picker's headers win over the router's parameter names (on this path only a client could have set those)
    assert tenant_of('{"maskedit_tenant":"vip","maskedit_tenant_weight":50,"x-maskedit-tenant":"acme",'
                     '"x-maskedit-tenant-weight":"2"}') == ("acme", 2.0)
    assert tenant_of('{"x-maskedit-tenant":"acme"}') == ("acme", 1.0)
    # a parameter of a header's name and the forwarded header: Triton's JSON holds the name twice
    for params in ('{"x-maskedit-tenant-weight":"100","x-maskedit-tenant":"acme","x-maskedit-tenant-weight":"2"}',
                   '{"x-maskedit-tenant":"acme","x-maskedit-tenant-weight":"2","x-maskedit-tenant-weight":"100"}'):
        with pytest.raises(InvalidInput, match="x-maskedit-tenant-weight: is reserved for the gateway's header"):
            tenant_of(params)
    # the same value twice: the picker's body keys and its header, were Triton to forward headers to /generate too
    assert tenant_of('{"x-maskedit-tenant":"acme","x-maskedit-tenant":"acme"}') == ("acme", 1.0)
    with pytest.raises(InvalidInput, match="x-maskedit-tenant-weight: must be a number from 0.01 to 100"):
        tenant_of('{"x-maskedit-tenant":"acme","x-maskedit-tenant-weight":"heavy"}')
    with pytest.raises(InvalidInput, match="x-maskedit-tenant-weight: must be a number from 0.01 to 100"):
        tenant_of('{"x-maskedit-tenant":"acme","x-maskedit-tenant-weight":"nan"}')
    with pytest.raises(InvalidInput, match="x-maskedit-tenant-weight: must be a number from 0.01 to 100"):
        tenant_of('{"x-maskedit-tenant":"acme","x-maskedit-tenant-weight":"1000"}')
    with pytest.raises(InvalidInput, match="x-maskedit-tenant: must be a tenant name"):
        tenant_of('{"x-maskedit-tenant":"a b"}')


def test_every_tritonserver_we_start_forwards_the_tenant_headers():
    import re

    from maskedit.launcher import TritonServer

    assert all(a in TritonServer().command() for a in TRITON_ARGS)
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert all(f'"{a}"' in dockerfile for a in TRITON_ARGS)
    assert re.match(FORWARD_PATTERN, "x-maskedit-tenant") and re.match(FORWARD_PATTERN, "x-maskedit-tenant-weight")
    assert not re.match(FORWARD_PATTERN, "x-maskedit-tenantx") and not re.match(FORWARD_PATTERN, "authorization")


def test_the_picker_sets_the_backend_key_and_strips_a_clients_copy(tmp_path):
    """Guarded backends (``backend_guard``): what the gateway sends on carries the backend key under both names (gRPC
    reads Triton's prefixed one, HTTP the plain one); a client's own copies are dropped. Without a key the picker
    sets none and still drops them."""
    from maskedit_common import backend_guard
    from maskedit_router.__main__ import build

    key = "b" * 32
    forged = [(backend_guard.HEADER, "guess-0123456789abcdef"), (backend_guard.GRPC_HEADER, "guess-0123456789abcdef")]
    for backend_key in (key, None):
        r = build(["10.0.0.1:8001"], resolution=256, backend_key=backend_key)
        try:
            headers, _ = run(EndpointPicker(r, keyring=keyring(tmp_path)), STREAM, "application/grpc", _grpc_body(),
                             [("authorization", f"Bearer {KEY}"), *forged])
        finally:
            for b in r.backends.values():
                b.close()
        sent = sorted((k, v) for k, v in headers if "backend-key" in k)
        assert sent == ([(backend_guard.GRPC_HEADER, key), (backend_guard.HEADER, key)] if backend_key else [])
