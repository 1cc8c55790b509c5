"""Stream limits of the router's gRPC ports: what bounds them is a configured number of streams, not threads.

An open stream costs a coroutine and its buffers (``proxy.aio``), so the bounds are explicit: at most ``max_streams``
open at once, at most ``max_streams_per_connection`` on one client connection (one TCP connection, ``peer()``),
each refused at once with RESOURCE_EXHAUSTED; and a stream with nothing in flight that has sent nothing for
``idle_timeout_s`` is ended, so a client that opens streams and forgets them frees them without dying.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamLimits:
    max_streams: int = 2048
    max_streams_per_connection: int = 256
    idle_timeout_s: float = 300.0  # 0: never
    # server-side HTTP/2 keepalive: a client whose host vanished (no FIN) is found within time + timeout
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0

    def __post_init__(self):
        for name in ("max_streams", "max_streams_per_connection"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "keepalive_time_s", "keepalive_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    def grpc_options(self) -> list[tuple[str, int]]:
        """Server options. HTTP/2's own per-connection stream limit stays above ours: a client over the HTTP/2
        limit queues its streams in its transport, unanswered (the starvation this replaces); over ours it is
        refused at once."""
        return [("grpc.max_concurrent_streams", self.max_streams_per_connection + 64),
                ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                ("grpc.http2.max_ping_strikes", 0)]


class StreamRefused(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # metrics label: streams_total, streams_connection


class StreamCounter:
    """Open streams, in total and per client connection. ``open`` admits a stream or raises ``StreamRefused``; every
    admitted stream is ``close``d exactly once."""

    def __init__(self, limits: StreamLimits, port_name: str = "router"):
        self.limits, self.port_name = limits, port_name
        self.total = 0
        self.by_peer: dict[str, int] = {}
        self._lock = threading.Lock()

    def open(self, peer: str) -> None:
        lim = self.limits
        with self._lock:
            if self.total >= lim.max_streams:
                raise StreamRefused("streams_total", f"RESOURCE_EXHAUSTED: the {self.port_name} has {self.total} "
                                    f"streams open, its limit (max_streams {lim.max_streams}); retry later")
            n = self.by_peer.get(peer, 0)
            if n >= lim.max_streams_per_connection:
                raise StreamRefused("streams_connection", f"RESOURCE_EXHAUSTED: this connection ({peer}) has {n} "
                                    f"streams open on the {self.port_name}, its limit (max_streams_per_connection "
                                    f"{lim.max_streams_per_connection})")
            self.total += 1
            self.by_peer[peer] = n + 1

    def close(self, peer: str) -> None:
        with self._lock:
            self.total -= 1
            n = self.by_peer.get(peer, 0) - 1
            if n > 0:
                self.by_peer[peer] = n
            else:
                self.by_peer.pop(peer, None)


class IdleClock:
    """When a stream last did something: received a message or ended a request. It is idle once nothing is in
    flight on it and that was ``timeout_s`` ago."""

    def __init__(self, timeout_s: float, now: float):
        self.timeout_s, self.last = timeout_s, now

    def touch(self, now: float) -> None:
        self.last = now

    def expired(self, busy: bool, now: float) -> bool:
        return bool(self.timeout_s) and not busy and now - self.last >= self.timeout_s

    def wait_s(self, busy: bool, now: float) -> float | None:
        """How long to wait before asking again (None: no timeout)."""
        if not self.timeout_s:
            return None
        if busy:
            return self.timeout_s
        return max(0.01, self.timeout_s - (now - self.last))


@dataclass(frozen=True)
class HttpLimits:
    """The OpenAI HTTP port (aiohttp: a connection costs a coroutine). ``max_requests`` edits served at once, more
    answered 429 at once; a body that has not fully arrived within ``body_timeout_s`` is answered 408; a
    connection idle between requests, or one that has not sent a whole request head, is closed after
    ``keepalive_timeout_s`` (aiohttp's keep-alive timer runs from the connection's start)."""

    max_requests: int = 64
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 15.0

    def __post_init__(self):
        if self.max_requests < 1:
            raise ValueError(f"max_requests: must be at least 1, got {self.max_requests}")
        for name in ("body_timeout_s", "keepalive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
