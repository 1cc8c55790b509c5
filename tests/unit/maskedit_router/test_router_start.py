"""The one place a router starts (``maskedit_router.__main__.start``, what ``python -m maskedit_router``, the lab
cluster behind ``make serve INSTANCES=N`` and the load tools use), before a fake backend (no Triton): the settings'
key file closes every port (gRPC UNAUTHENTICATED, HTTP and OpenAI 401) and without one the log says it is open in
one line; every call the router makes on a backend carries the backend key; the launchers make a backend key
whenever keys are on and hand it to Triton as its restricted-protocol flags; a failed TLS handshake is one log line
and a count, never a traceback; Triton's own queue refusals read as RESOURCE_EXHAUSTED."""

import logging
import socket
import ssl
import stat
import time
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from maskedit.launcher import TritonServer, free_ports
from maskedit_client import EditError
from maskedit_common import backend_guard
from maskedit_common.triton_refusals import as_refusal
from maskedit_lab.harness.cluster import backend_env, router_security_args
from maskedit_router.__main__ import parser, start
from maskedit_router.proxy.backend import Backend
from maskedit_router.proxy.health import probe
from tests.tls_certs import make_cert

KEY = "sk-acme-0123456789abcdef"
BACKEND_KEY = "k" * 40


class _Backend(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Records the metadata of every call; answers a stream request with what ``answer`` says."""

    def __init__(self):
        self.metadata, self.answer = [], None

    def ServerMetadata(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return service_pb2.ServerMetadataResponse(name="fake", version="0")

    def ServerReady(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelStreamInfer(self, request_iterator, context):
        self.metadata.append(dict(context.invocation_metadata()))
        for req in request_iterator:
            resp = service_pb2.ModelStreamInferResponse(error_message=self.answer or "")
            resp.infer_response.id = req.id
            if not self.answer:
                resp.infer_response.parameters["triton_final_response"].bool_param = True
            yield resp


@pytest.fixture
def fake():
    backend = _Backend()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(backend, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield backend, f"127.0.0.1:{port}"
    srv.stop(0).wait(10)


@pytest.fixture
def started():
    """``start(argv, env)`` with the settings of ``env``; every router started is stopped."""
    running = []

    def go(argv, monkeypatch=None, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, str(v))
        r = start(parser().parse_args(argv), {"interval_s": 60.0})
        running.append(r)
        return r

    yield go
    for r in running:
        r.stop()


def _status(url, data=None, headers=None, context=None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}), timeout=10,
                                    context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _ports():
    g, h, o = free_ports(3)
    return g, h, o, ["--port", str(g), "--http-port", str(h), "--openai-port", str(o)]


def test_the_settings_key_file_closes_every_port_and_the_router_sends_the_backend_key(fake, started, monkeypatch,
                                                                                     tmp_path):
    backend, addr = fake
    keys, bkey = tmp_path / "keys.txt", tmp_path / "backend.key"
    keys.write_text(f"{KEY} acme user\n")
    bkey.write_text(BACKEND_KEY + "\n")
    g, h, o, ports = _ports()
    started(["--backends", addr, *ports], monkeypatch,
            {"MASKEDIT_API_KEYS_FILE": keys, "MASKEDIT_BACKEND_KEY_FILE": bkey})
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{g}"))
    with pytest.raises(grpc.RpcError) as e:
        stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _status(f"http://127.0.0.1:{h}/v2/models/edit") == 401
    assert _status(f"http://127.0.0.1:{o}/v1/images/edits", b"x", {"Content-Type": "text/plain"}) == 401
    assert _status(f"http://127.0.0.1:{o}/v1/models") == 401
    # with the key: forwarded to the backend, which gets the backend key and never the caller's
    stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=10,
                        metadata=(("authorization", f"Bearer {KEY}"),))
    md = backend.metadata[-1]
    assert md.get(backend_guard.GRPC_HEADER) == BACKEND_KEY and "authorization" not in md


def test_without_a_key_file_the_router_says_in_one_line_that_it_is_open(fake, started, monkeypatch, caplog):
    backend, addr = fake
    monkeypatch.delenv("MASKEDIT_API_KEYS_FILE", raising=False)
    monkeypatch.delenv("MASKEDIT_BACKEND_KEY_FILE", raising=False)
    *_, ports = _ports()
    with caplog.at_level(logging.INFO, logger="maskedit.router"):
        r = started(["--backends", addr, *ports])
    open_lines = [m for m in caplog.messages if "open mode" in m]
    assert len(open_lines) == 1, caplog.messages
    assert not r.keyring.enabled and r.router.backend_key is None


def test_every_call_on_a_backend_carries_the_backend_key_the_probe_included(fake):
    backend, addr = fake
    b = Backend(addr, key=BACKEND_KEY)
    try:
        b.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10)
        assert probe(b, 10.0)  # the health probe's stream
        assert [m.get(backend_guard.GRPC_HEADER) for m in backend.metadata] == [BACKEND_KEY] * 2
    finally:
        b.close()
    plain = Backend(addr)  # the control: without a key, nothing is added
    try:
        plain.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10)
        assert backend_guard.GRPC_HEADER not in backend.metadata[-1]
    finally:
        plain.close()


def test_a_busy_backends_triton_queue_refusal_is_a_refusal_everywhere(fake):
    """Triton's own refusal in front of pre-processing carries no status name: the router's probe counts it as alive
    and busy (not dead), and the client reads it as RESOURCE_EXHAUSTED."""
    backend, addr = fake
    text = "in ensemble 'edit', [request id: r-1] Exceeds maximum queue size"
    backend.answer = text
    b = Backend(addr)
    try:
        assert probe(b, 10.0)
    finally:
        b.close()
    assert as_refusal(text).startswith("RESOURCE_EXHAUSTED: ") and text in as_refusal(text)
    assert as_refusal("in ensemble 'edit', Request timeout expired").startswith("RESOURCE_EXHAUSTED: ")
    assert as_refusal("INVALID_ARGUMENT: MASK: bad") == "INVALID_ARGUMENT: MASK: bad"
    assert EditError.from_server(text).code == "RESOURCE_EXHAUSTED"
    # the backend's intake refuses on arrival with the status name in front: passed through unchanged, a refusal
    intake = ("in ensemble 'edit', RESOURCE_EXHAUSTED: pre-processing's queue is full (16 waiting; refused on "
              "arrival, before any work): send again later or to another server [request id: r-2]")
    assert as_refusal(intake) == intake and EditError.from_server(intake).code == "RESOURCE_EXHAUSTED"
    backend.answer = intake
    b = Backend(addr)
    try:
        assert probe(b, 10.0)  # alive and busy
    finally:
        b.close()
    backend.answer = "INTERNAL: something broke"  # the control: another error is no refusal
    b = Backend(addr)
    try:
        assert not probe(b, 10.0)
    finally:
        b.close()


def test_the_launchers_guard_the_backends_whenever_keys_are_on(tmp_path, monkeypatch):
    for name in ("MASKEDIT_API_KEYS_FILE", "MASKEDIT_BACKEND_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert backend_env(tmp_path / "off") == {}  # keys off: the backends stay open
    env = backend_env(tmp_path / "on", {"MASKEDIT_API_KEYS_FILE": str(tmp_path / "keys.txt")})
    path = tmp_path / "on" / "backend.key"
    assert env == {"MASKEDIT_BACKEND_KEY_FILE": str(path)}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(backend_guard.read(path)) == 48
    assert backend_env(tmp_path / "x", keys=True)["MASKEDIT_BACKEND_KEY_FILE"].endswith("backend.key")
    configured = {"MASKEDIT_BACKEND_KEY_FILE": "/etc/k"}
    assert backend_env(tmp_path / "y", configured) == configured
    # the router is given what the backends are
    assert router_security_args(env)[-2:] == ["--backend-key-file", str(path)]
    # Triton gets its restricted-protocol flags from the same setting, with every group but health
    cmd = TritonServer(env=env).command()
    key = backend_guard.read(path)
    groups = "inference,metadata,model-config,model-repository,statistics,shared-memory,trace,logging"
    assert f"--grpc-restricted-protocol={groups}:{backend_guard.HEADER}={key}" in cmd
    assert f"--http-restricted-api={groups}:{backend_guard.HEADER}={key}" in cmd
    assert not any("restricted" in a for a in TritonServer().command())


def test_a_bad_backend_key_file_stops_the_start_naming_the_file_not_the_key(tmp_path):
    bad = tmp_path / "backend.key"
    bad.write_text("short\n")
    with pytest.raises(ValueError, match="backend key file .*backend.key") as e:
        backend_guard.read(bad)
    assert "short" not in str(e.value)
    with pytest.raises(ValueError, match="No such file"):
        backend_guard.read(tmp_path / "missing")


def test_a_failed_tls_handshake_is_one_line_and_a_count_never_a_traceback(fake, started, monkeypatch, tmp_path,
                                                                          capfd, caplog):
    backend, addr = fake
    cert, key = make_cert(tmp_path / "tls")
    monkeypatch.delenv("MASKEDIT_API_KEYS_FILE", raising=False)
    g, h, o, ports = _ports()
    with caplog.at_level(logging.INFO, logger="maskedit.router"):
        r = started(["--backends", addr, *ports, "--tls-cert", str(cert), "--tls-key", str(key)])
        for port in (h, o):
            with socket.create_connection(("127.0.0.1", port)) as s:  # a plaintext client on a TLS port
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                s.settimeout(5)
                try:
                    s.recv(100)
                except OSError:
                    pass
            try:  # a client that does not trust the certificate
                with socket.create_connection(("127.0.0.1", port)) as s:
                    ssl.create_default_context().wrap_socket(s, server_hostname="localhost")
            except ssl.SSLError:
                pass
        time.sleep(1.0)
    err = capfd.readouterr().err
    assert "Traceback" not in err
    lines = [m for m in caplog.messages if "TLS handshake failed" in m]
    assert sum("http port" in m for m in lines) == 2 and sum("openai port" in m for m in lines) == 2, lines
    from prometheus_client import generate_latest

    lines = generate_latest(r.router.metrics.registry).decode().splitlines()
    counts = {ln.split("{")[1].split("}")[0]: float(ln.split()[-1]) for ln in lines
              if ln.startswith("maskedit_router_tls_handshake_failures_total{")}
    assert counts == {'port="http"': 2.0, 'port="openai"': 2.0}
    ctx = ssl.create_default_context(cafile=str(cert))  # the control: a trusting client is served
    assert _status(f"https://localhost:{h}/health", context=ctx) in (200, 503)


@pytest.mark.parametrize("flag", ["--admission-poll-s", "--admission-idle-poll-s"])
def test_an_admission_poll_interval_of_zero_stops_the_start_naming_the_flag(flag):
    with pytest.raises(ValueError, match=f"{flag}: must be > 0"):
        start(parser().parse_args(["--backends", "127.0.0.1:1", flag, "0"]))
