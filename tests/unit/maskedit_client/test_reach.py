"""Nothing (or the wrong thing) at the client's address: the first request fails within seconds, naming the
address and the likely cause, instead of being retried silently until its deadline (600 s by default); the CLI
says the same and exits 1. An endpoint that comes up within the connect timeout is taken."""

import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from maskedit.launcher import free_port
from maskedit_client import EditClient, EditError
from maskedit_client import reach
from tests.conftest import png

TPL, MASK = png(np.full((32, 32, 3), 128, np.uint8)), png(np.zeros((32, 32), np.uint8))
# The connect timeout the tests give, and what "within seconds" allows on a loaded host: far below the deadline
# (600 s) a silent retry would run to, which is what the old client did.
CONNECT_S, FAST_S = 1.0, 15.0


def _edit_error(url: str) -> tuple[EditError, float]:
    t0 = time.monotonic()
    with EditClient(url, connect_timeout_s=CONNECT_S) as c, pytest.raises(EditError) as e:
        c.edit(TPL, MASK, "a hat")
    return e.value, time.monotonic() - t0


def test_nothing_listening_fails_fast_naming_the_address_and_cause():
    url = f"127.0.0.1:{free_port()}"
    err, took = _edit_error(url)
    assert err.code == "UNAVAILABLE" and took < FAST_S, (str(err), took)
    assert f"cannot reach {url}: nothing is listening at {url} (connection refused)" in str(err)
    assert "make serve" in str(err)  # the likely fix


def test_a_listener_that_is_not_grpc_is_told_apart():
    with socket.socket() as s:  # accepts TCP, never speaks HTTP/2 (an HTTP port, or TLS expected)
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        url = f"127.0.0.1:{s.getsockname()[1]}"
        err, took = _edit_error(url)
    assert err.code == "UNAVAILABLE" and took < FAST_S
    assert f"something is listening at {url}, but no gRPC connection was made" in str(err), str(err)


def test_an_endpoint_that_comes_up_within_the_connect_timeout_is_taken():
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(1))
    timer = threading.Timer(0.5, lambda: (server.add_insecure_port(f"127.0.0.1:{port}"), server.start()))
    timer.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.initial_reconnect_backoff_ms", 100),
                                                                     ("grpc.max_reconnect_backoff_ms", 200)])
    try:
        assert reach.connected(channel, 10.0)
    finally:
        timer.join()
        channel.close()
        server.stop(0)


def test_the_cli_says_where_and_why_and_exits_1(tmp_path):
    (tmp_path / "t.png").write_bytes(TPL)
    (tmp_path / "m.png").write_bytes(MASK)
    url = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "maskedit_client.cli", "--url", url, "--connect-timeout",
                           str(CONNECT_S), "--template", str(tmp_path / "t.png"), "--mask", str(tmp_path / "m.png"),
                           "--prompt", "a hat", "--out", str(tmp_path / "r.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and time.monotonic() - t0 < FAST_S + 10  # + the interpreter's start
    assert proc.stderr.startswith(f"error: UNAVAILABLE: cannot reach {url}: nothing is listening"), proc.stderr
    assert "Traceback" not in proc.stderr and "no longer in valid state" not in proc.stderr
    assert not (tmp_path / "r.png").exists()
