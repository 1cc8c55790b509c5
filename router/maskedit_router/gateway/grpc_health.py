"""The gRPC Health Checking Protocol (``grpc.health.v1.Health/Check``) for the endpoint picker, as the GIE
protocol asks: ``liveness`` (the process answers), ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``
(some pod is in rotation). Kubernetes' ``grpc`` probes call it.

Its two messages have one field each, so they are read and written here on the wire instead of adding the
``grpcio-health-checking`` package, whose releases for this grpcio need a newer protobuf than tritonclient allows.
"""

from __future__ import annotations

from typing import Callable

import grpc

SERVING, NOT_SERVING = 1, 2
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"


def _service_name(request: bytes) -> str:
    """``HealthCheckRequest.service`` (field 1, a string shorter than 128 bytes: one-byte length)."""
    if len(request) >= 2 and request[0] == 0x0A and request[1] < 0x80:
        return request[2:2 + request[1]].decode("utf-8", "replace")
    return ""


def _status(status: int) -> bytes:
    return bytes([0x08, status])  # HealthCheckResponse.status (field 1, enum)


def handler(ready: Callable[[], bool]) -> grpc.GenericRpcHandler:
    def check(request: bytes, context) -> bytes:
        service = _service_name(request)
        if service in ("", "liveness"):
            return _status(SERVING)
        if service in ("readiness", EXT_PROC):
            return _status(SERVING if ready() else NOT_SERVING)
        context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")

    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(check, request_deserializer=None, response_serializer=None)})


def aio_handler(ready: Callable[[], bool]) -> grpc.GenericRpcHandler:
    """The same for a ``grpc.aio`` server (its ``abort`` is a coroutine)."""

    async def check(request: bytes, context) -> bytes:
        service = _service_name(request)
        if service in ("", "liveness"):
            return _status(SERVING)
        if service in ("readiness", EXT_PROC):
            return _status(SERVING if ready() else NOT_SERVING)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")

    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(check, request_deserializer=None, response_serializer=None)})
