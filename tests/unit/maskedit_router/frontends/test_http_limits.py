"""The OpenAI HTTP port against slow and idle clients (raw sockets; no Triton: nothing gets past the body)."""

import json
import socket
import time

import pytest

from maskedit_router.access.limits import HttpLimits
from maskedit_router.frontends.openai_api import OpenAIServer
from maskedit_router.metrics import RouterMetrics

HEAD = ("POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        "Content-Length: 100000\r\n\r\n").encode()


@pytest.fixture
def api():
    metrics = RouterMetrics()
    server = OpenAIServer("127.0.0.1:1", 0, limits=HttpLimits(max_requests=1, body_timeout_s=3.0,
                                                             keepalive_timeout_s=1.0), metrics=metrics).start()
    socks = []

    def connect():
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        socks.append(s)
        return s

    yield {"connect": connect, "metrics": metrics}
    for s in socks:
        s.close()
    server.stop()


def _answer(sock) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0])
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), json.loads(body)


def test_a_slow_body_is_answered_408_and_while_it_holds_the_only_place_another_edit_gets_429_at_once(api):
    slow = api["connect"]()
    slow.sendall(HEAD + b"--b\r\n")  # a body that trickles: it holds the one place being served
    time.sleep(0.2)
    other = api["connect"]()
    t0 = time.monotonic()
    other.sendall(HEAD)
    status, body = _answer(other)
    # at once: well inside the ~2.8 s the slow body still holds the place (the 429 does not wait for it)
    assert status == 429 and "max_requests 1" in body["error"]["message"] and time.monotonic() - t0 < 2.0
    assert api["metrics"].refusals.labels("http_busy")._value.get() == 1
    status, body = _answer(slow)
    assert status == 408 and "body_timeout_s" in body["error"]["message"]


@pytest.mark.parametrize("sent", [b"", b"POST /v1/images/edits HTTP/1.1\r\nHost: x\r\n"], ids=["idle", "slow-head"])
def test_an_idle_connection_or_an_unfinished_head_is_closed(api, sent):
    s = api["connect"]()
    s.sendall(sent)
    t0 = time.monotonic()
    assert s.recv(1024) == b""  # closed by the server
    assert 0.5 < time.monotonic() - t0 < 5.0


def test_bad_http_limits_name_the_field():
    with pytest.raises(ValueError, match="body_timeout_s"):
        HttpLimits(body_timeout_s=0)
