"""Whether an endpoint can be reached, said within seconds instead of after a request's whole deadline.

A client's first connection is waited for at most ``connect_timeout_s`` (gRPC's own connect, with the channel's
reconnect backoff, so an endpoint that comes up meanwhile is taken). If none is made, one plain TCP connect tells the
likely cause apart: nothing listening, an unknown host, no answer at all, or a listener that never completed a gRPC
connection (an HTTP port, or TLS on one side only). Once an endpoint has been reached, its going away is a restart
the client retries through (``retry``), not this error.
"""

from __future__ import annotations

import socket

import grpc

# What a user of this repository most likely meant to reach.
HINT = ("is the server up? `make serve` listens for gRPC on 8001; the router (`make serve INSTANCES=2`) on 7001")


def connected(channel: grpc.Channel, timeout_s: float) -> bool:
    """True once ``channel`` is connected (within ``timeout_s``)."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        ready.cancel()


def split(url: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too) as a pair, or None for anything else (a unix socket, no port)."""
    host, sep, port = url.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def likely_cause(url: str, waited_s: float, tls: bool, probe_s: float = 2.0) -> str:
    """Why no gRPC connection to ``url`` was made in ``waited_s``, found by one TCP connect."""
    addr = split(url)
    if addr is None:
        return f"no gRPC connection to {url} within {waited_s:g} s"
    try:
        socket.create_connection(addr, timeout=probe_s).close()
    except ConnectionRefusedError:
        return f"nothing is listening at {url} (connection refused); {HINT}"
    except socket.gaierror as e:
        return f"cannot resolve the host {addr[0]!r} of {url} ({e.strerror})"
    except (socket.timeout, TimeoutError):
        return f"{url} did not answer a TCP connect within {probe_s:g} s (a wrong address, or a firewall)"
    except OSError as e:
        return f"cannot connect to {url} ({e.strerror or e}); {HINT}"
    other = ("the server may not use TLS: drop --ca-file / tls" if tls else
             "a TLS port needs --ca-file (EditClient(ca_file=...)); or is it an HTTP port (8000, 7002), not gRPC?")
    return f"something is listening at {url}, but no gRPC connection was made within {waited_s:g} s: {other}"
