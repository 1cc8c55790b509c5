"""One backend Triton as the router sees it: its channel, its circuit breaker, its admission gauge and the router's
books on it (``policies.BackendLoad``); the ticket of a request routed to it; the calls the router makes on it
outside a client's request (``cancel``, the health probe's edit).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

import collections

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from maskedit_common import backend_guard

from ..placement.features import EditFeatures
from ..placement.policies import BackendLoad, Booking
from .admission import AdmissionGauge

log = logging.getLogger("maskedit.router")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
# Errors meaning the backend could not run the request at all: Triton 2.51 answers every request to a model whose
# Python stub died with this, while its health endpoints still say ready.
BACKEND_FAULT = re.compile(r"Stub process .* is not healthy")


def backend_fault(message: str) -> bool:
    return bool(BACKEND_FAULT.search(message or ""))


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class KeyHeader(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the backend key (``backend_guard``) to every call on a channel: a guarded Triton refuses calls
    without it."""

    def __init__(self, key: str):
        self.md = backend_guard.grpc_metadata(key)

    def _details(self, d):
        md = [m for m in (d.metadata or ()) if m[0] != backend_guard.GRPC_HEADER] + list(self.md)
        return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def backend_channel(addr: str, key: str | None = None) -> grpc.Channel:
    """A channel to the Triton at ``addr``; with ``key``, every call on it carries the backend key."""
    channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(channel, KeyHeader(key)) if key else channel


class Backend:
    """One Triton instance as the router sees it. It is in rotation when it is healthy (the health checker's
    latest verdict) and its circuit breaker is closed. The breaker opens on a definite fault (a dead stub answered,
    a health check failed) or after ``failure_threshold`` failures in a row (a broken stream, an UNAVAILABLE
    answer), and closes only
    when a real request succeeds on it (the health checker's probe request, once the backend says ready again):
    a restarted backend is not trusted because it answers readiness, only once it has served an edit."""

    def __init__(self, addr: str, failure_threshold: int = 3, admission: dict | None = None, key: str | None = None):
        self.addr = addr
        self.channel = backend_channel(addr, key)  # ``key``: the backend key, sent on every call
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.load = BackendLoad(addr)
        self.failures, self.threshold = 0, failure_threshold
        self.circuit_open = False
        self.opened_at: float | None = None  # monotonic time the breaker last opened
        self.last_answer = 0.0  # monotonic time of its latest response (any: progress, result, error)
        self.admission = AdmissionGauge(**(admission or {}))  # its queue in front of its admission check

    def available(self, now: float | None = None) -> bool:
        return self.load.healthy and not self.circuit_open

    def failed(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_circuit()

    def trip(self) -> None:
        """A definite fault, not a timeout that may pass: out of rotation at once."""
        self.failures = max(self.failures, self.threshold)
        self.open_circuit()

    def open_circuit(self) -> None:
        if not self.circuit_open:
            self.circuit_open, self.opened_at = True, time.monotonic()
        self.load.forget()  # its caches are no longer trusted

    def succeeded(self) -> None:
        """A real request succeeded on it: the breaker closes."""
        self.failures = 0
        self.circuit_open = False

    def close(self) -> None:
        self.channel.close()


@dataclass
class Ticket:
    backend: Backend
    features: EditFeatures
    booking: Booking
    t0: float = field(default_factory=time.monotonic)
    key: str | None = None  # its entry in the backend's admission gauge (an edit the router sends itself)


class NoBackend(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _cancel_on_backend(backend: Backend, ids: list[str]) -> None:
    try:
        req = service_pb2.ModelInferRequest(model_name="cancel")
        t = req.inputs.add()
        t.name, t.datatype = "REQUEST_IDS", "BYTES"
        t.shape.append(len(ids))
        t.contents.bytes_contents.extend([i.encode() for i in ids])
        backend.stub.ModelInfer(req, timeout=5)
    except grpc.RpcError as e:
        log.info("cancel on %s failed: %s", backend.addr, e.code().name)


def probe_edit_request() -> object:
    """A real request through every stage that does no model work (empty mask): used as a health probe."""
    from maskedit_client import encode_image

    req = service_pb2.ModelInferRequest(model_name="edit", id="health-probe")
    for name, value in (("TEMPLATE", encode_image(np.full((16, 16, 3), 128, np.uint8))),
                        ("MASK", encode_image(np.zeros((16, 16), np.uint8))),
                        ("PROMPT", b"health probe")):
        t = req.inputs.add()
        t.name, t.datatype = name, "BYTES"
        t.shape.append(1)
        t.contents.bytes_contents.append(value)
    req.parameters[EMPTY_FINAL].bool_param = True
    return req
