"""TLS of the router's ports from a certificate and its key (PEM files named by settings / flags): grpcio's own
TLS for the gRPC port, Python's ``ssl`` for the HTTP ports (the stdlib server of Triton's HTTP protocol, aiohttp for
the OpenAI API). Both files are read once at start.

A failed handshake (a plaintext client, an untrusted certificate, a scanner: anyone can open a connection) is one
log line at info and a count in ``maskedit_router_tls_handshake_failures_total{port}`` on the HTTP ports
(``handshake_failed``), never a traceback; on the gRPC port grpc's core logs its own one line
("Handshake failed with error ...") and grpcio offers no hook to count it."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

log = logging.getLogger("maskedit.router")


def handshake_failed(metrics, port: str, exc: BaseException, peer: str | None = None) -> None:
    """One line (the reason OpenSSL gives, e.g. ``HTTP_REQUEST``, ``TLSV1_ALERT_UNKNOWN_CA``) and the count."""
    if metrics is not None:
        metrics.tls_failed(port)
    log.info("TLS handshake failed on the %s port%s: %s", port, f" from {peer}" if peer else "",
             getattr(exc, "reason", None) or type(exc).__name__)


def _counting(on_failure: Callable[[BaseException], None]) -> type:
    """An ``SSLObject`` (what asyncio, hence aiohttp, handshakes with) that reports a failed handshake."""

    class Counting(ssl.SSLObject):
        def do_handshake(self):
            try:
                return super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):  # not a failure: more bytes to come
                raise
            except ssl.SSLError as e:
                on_failure(e)
                raise

    return Counting


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path

    @classmethod
    def of(cls, cert, key) -> "TlsFiles | None":
        """Both or neither: one without the other is a start-up error."""
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        for p in (cert, key):
            if not Path(p).is_file():
                raise ValueError(f"TLS: {p} is not a file")
        return cls(Path(cert), Path(key))

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])

    def ssl_context(self, on_failure: Callable[[BaseException], None] | None = None) -> ssl.SSLContext:
        """``on_failure``: called with the error of each failed handshake done through ``SSLObject`` (asyncio's
        servers; the stdlib HTTP server reports its own in ``handle_error``)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        if on_failure is not None:
            ctx.sslobject_class = _counting(on_failure)
        return ctx
