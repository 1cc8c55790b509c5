"""A client that goes away before its answer is written (a health checker's or scraper's timeout, a closed browser
tab, a cancelled SDK call) is the client's business: one counted, structured line, never a traceback. The router's
HTTP servers (``/metrics``, ``/health`` and Triton's HTTP/REST protocol on one port; the OpenAI port) report it here."""

from __future__ import annotations

import logging
import ssl
import sys
from http.server import ThreadingHTTPServer

log = logging.getLogger("maskedit.router")
# what writing to (or reading from) a socket whose peer has gone raises
DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


def note(metrics, port: str, path: str, error: BaseException | str) -> None:
    if metrics is not None:
        metrics.client_gone(port)
    log.info("client disconnected", extra={"fields": {
        "port": port, "path": path, "error": error if isinstance(error, str) else type(error).__name__}})


class HttpServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` whose handler threads report a disconnected client with ``note`` instead of
    socketserver's traceback on stderr; any other error is logged (structured, with its traceback)."""

    daemon_threads = True

    def __init__(self, address, handler, metrics=None, port_name: str = "http"):
        super().__init__(address, handler)
        self.metrics, self.port_name = metrics, port_name

    def handle_error(self, request, client_address) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, ssl.SSLError):  # a failed TLS handshake (anyone can send garbage): one line and a count
            from ..access.tls import handshake_failed

            handshake_failed(self.metrics, self.port_name, e, client_address[0])
            return
        if isinstance(e, DISCONNECTS):
            note(self.metrics, self.port_name, "", e)
            return
        log.error("HTTP request failed", exc_info=True, extra={"fields": {"port": self.port_name,
                                                                          "client": str(client_address[0])}})
