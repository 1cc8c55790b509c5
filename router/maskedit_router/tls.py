"""TLS of the router's ports from a certificate and its key (PEM files named by settings / flags): grpcio's own
TLS for the gRPC port, Python's ``ssl`` for the HTTP ports (the stdlib server of Triton's HTTP protocol, aiohttp for
the OpenAI API). Both files are read once at start."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


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

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx
