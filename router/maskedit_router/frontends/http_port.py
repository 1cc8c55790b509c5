"""The router's HTTP port: ``/metrics`` (Prometheus), ``/health`` (JSON) and, with ``kserve``, Triton's HTTP/REST
protocol under ``/v2`` (``kserve_http``), on one ``ThreadingHTTPServer`` (``client_gone.HttpServer``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..access.auth import Forbidden, Keyring, Unauthenticated, admin_path
from ..access.tenancy import retry_after
from ..metrics import RouterMetrics
from .client_gone import DISCONNECTS, HttpServer, note
from .kserve_http import HttpError

MAX_BODY_BYTES = 96 << 20  # as the OpenAI port: a 4096x4096 template and its mask as PNG, with room


def serve_http(port: int, metrics: RouterMetrics, health_fn, host: str = "127.0.0.1",
               kserve=None, keyring=None, ssl_context=None):
    """``/metrics`` (Prometheus) and ``/health`` (JSON: 200 when at least one backend is in rotation); with ``kserve``
    (``kserve_http.KServeHttp``) also Triton's HTTP/REST protocol under ``/v2``, whose routes (but
    ``/v2/health/*``) need an API key when ``keyring`` has a key file; TLS with ``ssl_context``."""
    keyring = keyring or Keyring()

    class Handler(BaseHTTPRequestHandler):
        def handle_one_request(self):
            try:
                super().handle_one_request()
            except DISCONNECTS as e:  # the client gave up (a scraper's or health checker's timeout): counted
                self.close_connection = True
                note(metrics, "http", getattr(self, "path", ""), e)

        def _authorized(self) -> tuple | None:
            """The gRPC metadata carrying the caller's key on; None when refused (401 / 403 sent)."""
            value = self.headers.get("Authorization")
            try:
                keyring.check(value, admin=admin_path(self.path))
            except Unauthenticated as e:
                metrics.auth_failed("http", "unauthenticated")
                self.close_connection = True
                self._send(401, "application/json", json.dumps({"error": f"UNAUTHENTICATED: {e}"}).encode(),
                           {"WWW-Authenticate": "Bearer"})
                return None
            except Forbidden as e:
                metrics.auth_failed("http", "forbidden")
                self._send(403, "application/json", json.dumps({"error": f"PERMISSION_DENIED: {e}"}).encode())
                return None
            return (("authorization", value),) if value else ()

        def do_GET(self):  # noqa: N802
            if self.path.startswith("/metrics"):
                body, ctype, code = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
            elif self.path.startswith("/health"):
                h = health_fn()
                body, ctype = json.dumps(h).encode(), "application/json"
                code = 200 if h.get("ready") else 503
            elif kserve is not None and (self.path == "/v2" or self.path.startswith("/v2/")):
                md = () if self.path.startswith("/v2/health/") else self._authorized()
                if md is None:
                    return
                code, doc = kserve.get(self.path, md)
                body, ctype = (json.dumps(doc).encode() if doc else b""), "application/json"
            else:
                body, ctype, code = b"not found", "text/plain", 404
            self._send(code, ctype, body)

        def do_POST(self):  # noqa: N802
            if kserve is None or not self.path.startswith("/v2/"):
                self._send(404, "text/plain", b"not found")
                return
            md = self._authorized()
            if md is None:
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
                if n > MAX_BODY_BYTES:
                    raise HttpError(413, f"request body is above the limit of {MAX_BODY_BYTES} bytes")
                kserve.acquire()
            except HttpError as e:
                self.close_connection = True
                self._send(e.status, "application/json", json.dumps({"error": str(e)}).encode())
                return
            except ValueError:
                self._send(400, "application/json", b'{"error": "bad Content-Length"}')
                return
            try:
                body = self.rfile.read(n)
                headers = {k.lower(): v for k, v in self.headers.items()}
                answer = kserve.post(self.path, body, headers, md)
                if len(answer) == 2:  # server-sent events
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    for chunk in answer[1]:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    return
                code, ctype, out, extra = answer
                self._send(code, ctype, out, extra)
            except HttpError as e:
                hint = retry_after(str(e)) if e.status == 429 else None
                self._send(e.status, "application/json", json.dumps({"error": str(e)}).encode(),
                           {"Retry-After": hint} if hint else None)
            except DISCONNECTS as e:
                self.close_connection = True
                note(metrics, "http", self.path, e)
            finally:
                kserve.slots.release()

        def _send(self, code, ctype, body, extra=None):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HttpServer((host, port), Handler, metrics)
    if ssl_context is not None:  # the handshake happens on the request's own thread, not in accept()
        httpd.socket = ssl_context.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="router-http").start()
    return httpd
