"""Keys, roles, per-key limits and TLS on the real router ports (grpc.aio, the HTTP port), in front of a fake backend
(no Triton): every route but the probes needs a key, a user key cannot change the served set, TLS with the CA
works and plaintext does not, metrics carry tenant names and never keys."""

import json
import ssl
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from maskedit_router.__main__ import build, serve
from maskedit_router.access.auth import Keyring
from maskedit_router.access.tls import TlsFiles
from tests.tls_certs import make_cert

USER, ADMIN, LIMITED = "sk-user-0123456789abcdef", "sk-admin-0123456789abcdef", "sk-limited-0123456789abcd"


class _Backend(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self):
        self.loaded = []

    def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="fake", version="0")

    def RepositoryModelLoad(self, request, context):
        self.loaded.append(request.model_name)
        return service_pb2.RepositoryModelLoadResponse()

    def ModelStreamInfer(self, request_iterator, context):
        for req in request_iterator:
            resp = service_pb2.ModelStreamInferResponse()
            resp.infer_response.id = req.id
            resp.infer_response.parameters["triton_final_response"].bool_param = True
            yield resp


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("sec")
    keys = d / "keys.txt"
    keys.write_text(f"{USER} acme user\n{ADMIN} ops admin\n{LIMITED} slowco user rps=0.2 burst=1\n")
    cert, key = make_cert(d / "tls")
    backend = _Backend()
    bsrv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(backend, bsrv)
    bport = bsrv.add_insecure_port("127.0.0.1:0")
    bsrv.start()
    r = build([f"127.0.0.1:{bport}"], resolution=256, admission_wait_s=0)
    from maskedit.launcher import free_port

    http_port = free_port()
    srv, port, httpd = serve(r, 0, http_port, keyring=Keyring(keys), tls=TlsFiles.of(cert, key))
    ch = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(cert.read_bytes()))
    ctx = ssl.create_default_context(cafile=str(cert))
    yield {"stub": service_pb2_grpc.GRPCInferenceServiceStub(ch), "port": port, "http": http_port, "ctx": ctx,
           "backend": backend, "router": r}
    ch.close()
    srv.stop(0).wait(10)
    httpd.shutdown()
    bsrv.stop(0).wait(10)
    for b in r.backends.values():
        b.close()


def _md(key):
    return (("authorization", f"Bearer {key}"),)


def test_grpc_calls_need_a_valid_key_and_probes_do_not(secured):
    stub = secured["stub"]
    with pytest.raises(grpc.RpcError) as e:
        stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=10, metadata=_md("sk-wrong-0123456789abc"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid API key" in e.value.details()
    assert stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=10, metadata=_md(USER)).name == "fake"
    assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live  # a probe: open
    with pytest.raises(grpc.RpcError) as e:  # a stream without a key never reaches a backend
        list(stub.ModelStreamInfer(iter([service_pb2.ModelInferRequest(model_name="edit", id="x")]), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_changing_the_served_set_needs_an_admin_key(secured):
    stub = secured["stub"]
    with pytest.raises(grpc.RpcError) as e:
        stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="edit"), timeout=10,
                                 metadata=_md(USER))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and secured["backend"].loaded == []
    stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="edit"), timeout=10,
                             metadata=_md(ADMIN))
    assert secured["backend"].loaded == ["edit"]


def test_a_key_over_its_rate_is_refused_at_once_with_a_retry_hint(secured):
    stub = secured["stub"]

    def req(i):
        r = service_pb2.ModelInferRequest(model_name="edit", id=f"r{i}")
        r.parameters["triton_enable_empty_final_response"].bool_param = True
        return r

    answers = list(stub.ModelStreamInfer(iter([req(0), req(1)]), timeout=10, metadata=_md(LIMITED)))
    errors = [a.error_message for a in answers if a.error_message]
    assert len(answers) == 2 and len(errors) == 1  # the burst of 1 admits one; the other is refused, not queued
    assert "RESOURCE_EXHAUSTED" in errors[0] and "retry after" in errors[0] and "slowco" in errors[0]


def _get(secured, path, key=None, method="GET", scheme="https"):
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{secured['http']}{path}", method=method,
                                 data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=secured["ctx"] if scheme == "https" else None) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_the_http_port_needs_keys_on_v2_and_leaves_health_and_metrics_open(secured):
    code, headers, _ = _get(secured, "/v2")
    assert code == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert _get(secured, "/v2", "sk-wrong-0123456789abc")[0] == 401
    code, _, body = _get(secured, "/v2", USER)
    assert code == 200 and json.loads(body)["name"] == "fake"
    assert _get(secured, "/v2/repository/models/edit/load", USER, "POST")[0] == 403
    assert _get(secured, "/health")[0] == 200 and _get(secured, "/metrics")[0] == 200


def test_tls_with_the_ca_works_and_plaintext_does_not(secured):
    with pytest.raises(grpc.RpcError) as e:  # a plaintext gRPC client on the TLS port
        with grpc.insecure_channel(f"127.0.0.1:{secured['port']}") as ch:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ServerMetadata(
                service_pb2.ServerMetadataRequest(), timeout=5, metadata=_md(USER))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Exception):  # plain HTTP on the TLS port
        _get(secured, "/health", scheme="http")
    assert _get(secured, "/health")[0] == 200  # HTTPS with the CA


def test_metrics_are_labelled_by_tenant_and_never_hold_a_key(secured):
    text = _get(secured, "/metrics")[2].decode()
    assert 'tenant="slowco"' in text and 'maskedit_router_tenant_refused_total{reason="rate",tenant="slowco"}' in text
    assert 'maskedit_router_auth_failures_total{port="grpc",reason="unauthenticated"}' in text
    for key in (USER, ADMIN, LIMITED):
        assert key not in text
