"""A client that gives up before its answer is written is one counted line on the router's HTTP port, never a
``BrokenPipeError`` traceback (the outside fault run found one for every client that gave up, issue 47)."""

import socket
import struct
import time

from maskedit_router.frontends.http_port import serve_http
from maskedit_router.metrics import RouterMetrics


def _give_up(port: int, path: str) -> None:
    """Send a request and reset the connection at once (SO_LINGER 0), before the answer comes."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _counted(metrics, port: str, n: int, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while metrics.client_disconnects.labels(port)._value.get() < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return metrics.client_disconnects.labels(port)._value.get()


def test_a_client_that_gives_up_on_health_is_counted_in_one_line_without_a_traceback(capfd, caplog):
    metrics = RouterMetrics()

    def slow_health():  # the answer comes after the client has gone
        time.sleep(0.3)
        return {"ready": True, "backends": [{"addr": "b", "pad": "x" * (1 << 20)}]}

    httpd = serve_http(0, metrics, slow_health)
    try:
        with caplog.at_level("INFO", logger="maskedit.router"):
            for _ in range(3):
                _give_up(httpd.server_address[1], "/health")
            assert _counted(metrics, "http", 3) == 3
    finally:
        httpd.shutdown()
    lines = [r for r in caplog.records if r.getMessage() == "client disconnected"]
    assert len(lines) == 3 and lines[0].fields["path"] == "/health" and lines[0].fields["port"] == "http"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_client_that_goes_away_mid_request_on_the_openai_port_is_counted(caplog):
    """Reset while its body was being read: aiohttp logged "Error handling request" with the traceback."""
    from maskedit_router.frontends.openai_api import OpenAIServer

    metrics = RouterMetrics()
    server = OpenAIServer("127.0.0.1:1", 0, metrics=metrics).start()
    try:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                  b"Content-Length: 100000\r\n\r\n--b\r\n")  # the body never finishes: the client gives up
        time.sleep(0.3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        assert _counted(metrics, "openai", 1) == 1
    finally:
        server.stop()
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
