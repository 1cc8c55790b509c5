"""The router as a Gateway API Inference Extension endpoint picker (EPP): Envoy's external-processing protocol.

A GIE gateway (Envoy Gateway, kgateway, GKE ...) opens one ``ExternalProcessor.Process`` stream per HTTP request
and sends its headers and body (``FULL_DUPLEX_STREAMED``, as the protocol requires). The picker reads the edit's
features from the body (``picker_body``), chooses a Triton pod with the router's own policy and books
(predicted latency + cache affinity, health checks: a ``Router`` over the pods' gRPC addresses), and answers:

- the request-headers response sets ``x-gateway-destination-endpoint: <ip:port>`` and the dynamic metadata
  ``envoy.lb / x-gateway-destination-endpoint`` to the same value (and clears the route cache);
- with API keys it also names the key's tenant to the pod: it removes the client's ``authorization`` and any
  ``x-maskedit-tenant[-weight]`` headers the client sent, and sets those two from the key (Triton forwards them
  to the backend's fair share as request parameters: ``maskedit_common.tenant_wire``); a generate endpoint's JSON
  body (where Triton forwards no headers) gets the same two as keys, and ``content-length`` follows;
- the request body goes back otherwise unchanged as ``streamed_response`` chunks; later phases pass through;
- only endpoints in the proxy's subset (``metadata_context`` ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset``) are eligible when it sends one; none eligible or none healthy: an
  immediate 503; the router's in-flight limits reached: 429; a body that cannot be read: 400 (gRPC requests get
  the matching grpc-status).

Decision point: JSON bodies (Triton's generate endpoints) at their end; gRPC bodies at their first complete
message (a stream stays on one pod: the gateway routes streams, not the messages in them); bodiless requests at
their headers. The booking ends when the ext_proc stream ends (the HTTP request is over).
Protocol: kubernetes-sigs/gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from maskedit_common import backend_guard
from maskedit_common.tenant_wire import HEADERS as TENANT_HEADERS, TENANT_HEADER, WEIGHT_HEADER, weight_text

from ..access.auth import Forbidden, Keyring, Unauthenticated
from ..access.auth import admin_path as http_admin
from ..access.limits import StreamCounter, StreamLimits, StreamRefused
from ..access.tenancy import OverLimit, retry_after_header
from ..proxy.aio import AioServer, idle_message
from ..proxy.backend import NoBackend, Ticket
from ..proxy.server import Router
from . import grpc_health, picker_body
from .extproc_wire import metadata_context, streamed_body

log = logging.getLogger("maskedit.router.picker")
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
GRPC_CODE = {400: 3, 401: 16, 403: 7, 429: 8, 503: 14}  # INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED,
# RESOURCE_EXHAUSTED, UNAVAILABLE
# paths that change the served set: admin keys only (Triton's repository load/unload, gRPC and HTTP; the adapters')
ADMIN_PATHS = ("/inference.GRPCInferenceService/RepositoryModelLoad",
               "/inference.GRPCInferenceService/RepositoryModelUnload", "/v1/load_lora_adapter",
               "/v1/unload_lora_adapter")
# Envoy multiplexes ext_proc streams on few connections: one connection may hold them all. A stream lives as long as
# its HTTP request, so it is idle only when nothing came for longer than the longest edit.
PICKER_LIMITS = StreamLimits(max_streams=4096, max_streams_per_connection=4096, idle_timeout_s=900.0)


class Refused(Exception):
    """End the HTTP request at the gateway with ``status`` (an immediate response)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s


def admin_path(path: str) -> bool:
    return path.split("?")[0] in ADMIN_PATHS or http_admin(path)


def subset(req: ep.ProcessingRequest) -> list[str] | None:
    """The endpoints the proxy allows for this request, None if it sent no subset."""
    md = metadata_context(req)
    if SUBSET_NAMESPACE not in md.filter_metadata:
        return None
    hint = md.filter_metadata[SUBSET_NAMESPACE]
    if SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    return [a.strip() for a in value.string_value.split(",") if a.strip()]


@dataclass
class _Exchange:
    """One HTTP request as the picker sees it."""

    headers: dict = field(default_factory=dict)
    path: str = ""
    body: bytearray = field(default_factory=bytearray)
    allowed: list | None = None
    ticket: Ticket | None = None
    endpoint: str | None = None
    status: int | None = None
    tenant: object = None  # auth.Tenant once its key is checked and its limits admitted it


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    """``router`` holds the pods (their Triton gRPC addresses, which its health checks use); the answer names the
    chosen pod's IP with the InferencePool's target port: ``target_port`` for gRPC requests (default: the gRPC
    address's own port), ``http_target_port`` for the others (Triton's HTTP port, for a pool of HTTP routes)."""

    def __init__(self, router: Router, target_port: int | None = None, http_target_port: int | None = None,
                 keyring: Keyring | None = None):
        self.r, self.target_port, self.http_target_port = router, target_port, http_target_port
        self.keyring = keyring or Keyring()

    def authorize(self, x: _Exchange) -> None:
        """The request's key (its ``authorization`` header) and its key's limits; refused with 401 / 403 / 429.
        The header is removed before the request goes on to the pod."""
        try:
            tenant = self.keyring.check(x.headers.get("authorization"), admin=admin_path(x.path))
        except Unauthenticated as e:
            self.r.metrics.auth_failed("picker", "unauthenticated")
            raise Refused(401, f"UNAUTHENTICATED: {e}") from None
        except Forbidden as e:
            self.r.metrics.auth_failed("picker", "forbidden")
            raise Refused(403, f"PERMISSION_DENIED: {e}") from None
        try:
            self.r.quotas.enter(tenant)
        except OverLimit as e:
            self.r.tenant_refused(tenant, e)
            raise Refused(429, str(e), e.retry_after_s) from None
        x.tenant = tenant

    # -- the choice ---------------------------------------------------------------------------------
    def endpoint(self, addr: str, grpc_request: bool = True) -> str:
        """How the gateway names the pod whose Triton gRPC address is ``addr``: its IP and the target port."""
        host, port = addr.rsplit(":", 1)
        target = self.target_port if grpc_request else (self.http_target_port or self.target_port)
        return f"{host}:{target or port}"

    def choose(self, x: _Exchange, features) -> None:
        grpc_request = picker_body.is_grpc(x.headers)
        named = {a: self.endpoint(a, grpc_request) for a in list(self.r.backends)}
        exclude = set() if x.allowed is None else {a for a, e in named.items() if e not in x.allowed}
        if x.allowed is not None and len(exclude) == len(named):
            raise Refused(503, f"none of the offered endpoints ({', '.join(x.allowed) or 'empty subset'}) is a "
                               "known model server")
        try:
            x.ticket = self.r.route(features, exclude=exclude)
        except NoBackend as e:
            raise Refused(429 if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else 503, str(e)) from None
        x.endpoint = named.get(x.ticket.backend.addr) or self.endpoint(x.ticket.backend.addr, grpc_request)
        log.info("picked", extra={"fields": {"endpoint": x.endpoint, "path": x.path, "template": features.template_key,
                                             "mask_ratio": round(features.mask_ratio, 4),
                                             "predicted_ms": round(x.ticket.booking.expected_ms, 1)}})

    # -- the protocol -------------------------------------------------------------------------------
    def Process(self, request_iterator, context):
        x = _Exchange()
        try:
            yield from self._process(x, request_iterator)
        except Refused as e:
            log.info("refused", extra={"fields": {"status": e.status, "path": x.path, "why": str(e)}})
            yield self._immediate(x, e.status, str(e), e.retry_after_s)
        finally:
            self.finished(x)

    def finished(self, x: _Exchange) -> None:
        """The HTTP request is over: its booking ends, its tenant's books close."""
        if x.tenant is not None:
            self.r.quotas.leave(x.tenant)
            self.r.metrics.tenant_ended(x.tenant.name, "ok" if x.status == 200 else "error")
            x.tenant = None
        if x.ticket is None:
            return
        # a single edit's latency refits the model; a gRPC stream's lifetime says nothing about one edit
        self.r.release(x.ticket, ok=x.status == 200 and not picker_body.is_grpc(x.headers))

    def _process(self, x: _Exchange, request_iterator):
        for req in request_iterator:
            yield from self.handle(x, req)

    def handle(self, x: _Exchange, req: ep.ProcessingRequest):
        """The answers to one message of the exchange (the aio transport calls it message by message)."""
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            x.headers = {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
                         for h in req.request_headers.headers.headers}
            x.path = x.headers.get(":path", "")
            self.authorize(x)
            x.allowed = subset(req)
            if req.request_headers.end_of_stream:  # no body: decide now
                self.choose(x, picker_body.NO_WORK)
                yield self._headers_answer(x)
        elif kind == "request_body":
            chunk = req.request_body
            if x.endpoint is not None:  # decided: the rest of the body passes through
                yield _body_answer(chunk.body, chunk.end_of_stream)
                return
            x.body += chunk.body
            features = self._features(x, chunk.end_of_stream)
            if features is None:
                return  # not enough of the body yet: Envoy keeps streaming it to us
            self.choose(x, features)
            body = self._tagged_body(x) if chunk.end_of_stream else None
            yield self._headers_answer(x, None if body is None else len(body))
            yield _body_answer(bytes(x.body) if body is None else body, chunk.end_of_stream)
            x.body = bytearray()
        elif kind == "request_trailers":
            if x.endpoint is None:  # a body that never completed a message: decide on what we have
                self.choose(x, picker_body.NO_WORK)
                yield self._headers_answer(x)
                yield _body_answer(bytes(x.body), False)
            yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
        elif kind == "response_headers":
            for h in req.response_headers.headers.headers:
                if h.key == ":status":
                    x.status = int(h.raw_value or h.value or 0)
            yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        elif kind == "response_body":
            if x.ticket is not None and req.response_body.body:
                # the pod answered through the gateway: alive, as the router's own streams count answers
                # (else the health checker probes a busy pod whose traffic it cannot see)
                x.ticket.backend.last_answer = time.monotonic()
            yield ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
                body_mutation=streamed_body(req.response_body.body, req.response_body.end_of_stream))))
        elif kind == "response_trailers":
            yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())

    def _features(self, x: _Exchange, end_of_stream: bool):
        try:
            if picker_body.is_grpc(x.headers):
                msg = picker_body.first_grpc_message(bytes(x.body))
                if msg is None:
                    if end_of_stream:
                        raise picker_body.BadBody("the body ended inside its first gRPC message")
                    return None
                return picker_body.grpc_features(x.path, msg, self.r.resolution)
            if not end_of_stream:
                return None
            return picker_body.json_features(x.path, bytes(x.body), self.r.resolution)
        except picker_body.BadBody as e:
            raise Refused(400, str(e)) from None

    def _tagged_body(self, x: _Exchange) -> bytes | None:
        """A whole JSON body rewritten to name the key's tenant (generate endpoints); None: it goes on as it came."""
        if not self.keyring.enabled or x.tenant is None or picker_body.is_grpc(x.headers):
            return None
        return picker_body.with_tenant(x.path, bytes(x.body), x.tenant.name, x.tenant.weight)

    def _headers_answer(self, x: _Exchange, body_length: int | None = None) -> ep.ProcessingResponse:
        """Where the request goes, and its headers: the key and the client's tenant headers removed, the key's tenant
        set (keys on); ``body_length``: the body was rewritten to that length."""
        sets = [(DESTINATION, x.endpoint)]
        removes = list(TENANT_HEADERS)  # only the picker names a tenant; open mode: nobody does on this path
        # The backend key: only the picker sets it (gRPC reads Triton's prefixed name, HTTP the plain one).
        removes += [backend_guard.HEADER, backend_guard.GRPC_HEADER]
        if self.r.backend_key:
            sets += [(backend_guard.HEADER, self.r.backend_key), (backend_guard.GRPC_HEADER, self.r.backend_key)]
        if self.keyring.enabled:
            removes.append("authorization")  # keys stay at the gateway
            if x.tenant is not None:
                sets += [(TENANT_HEADER, x.tenant.name), (WEIGHT_HEADER, weight_text(x.tenant.weight))]
        if body_length is not None:
            sets.append(("content-length", str(body_length)))
        mutation = ep.HeaderMutation(remove_headers=removes, set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in sets])
        dynamic = struct_pb2.Struct()
        dynamic.update({LB_NAMESPACE: {DESTINATION: x.endpoint}})
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation,
                                                                          clear_route_cache=True)),
            dynamic_metadata=dynamic)

    def _immediate(self, x: _Exchange, status: int, message: str,
                   retry_after_s: float | None = None) -> ep.ProcessingResponse:
        grpc_req = picker_body.is_grpc(x.headers)
        body = ('{"error": {"message": %s, "type": "%s", "param": null, "code": null}}' % (
            json.dumps(message), "invalid_request_error" if status < 500 else "server_error"))
        imm = ep.ImmediateResponse(status=http_status_pb2.HttpStatus(code=status), details=message,
                                   body=body if not grpc_req else "")
        if grpc_req:
            imm.grpc_status.status = GRPC_CODE.get(status, 2)
            imm.headers.set_headers.add(header=base_pb2.HeaderValue(key="grpc-message", raw_value=message.encode()))
        else:
            imm.headers.set_headers.add(header=base_pb2.HeaderValue(key="content-type",
                                                                     raw_value=b"application/json"))
        if retry_after_s is not None:
            imm.headers.set_headers.add(header=base_pb2.HeaderValue(
                key="retry-after", raw_value=retry_after_header(retry_after_s).encode()))
        if status == 401:
            imm.headers.set_headers.add(header=base_pb2.HeaderValue(key="www-authenticate", raw_value=b"Bearer"))
        return ep.ProcessingResponse(immediate_response=imm)


def _body_answer(body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=streamed_body(body, end_of_stream))))


class PickerService:
    """The aio face of ``EndpointPicker`` (Envoy's ``ExternalProcessor.Process``). Envoy multiplexes many
    ext_proc streams on few connections, so its per-connection limit defaults to the total one. An ext_proc stream
    lives as long as its HTTP request: it is idle only when nothing came for the whole idle timeout (900 s by
    default, longer than the router's longest edit)."""

    def __init__(self, picker, limits: StreamLimits):
        self.p, self.limits = picker, limits  # picker.PICKER_LIMITS by default
        self.streams = StreamCounter(limits, "endpoint picker")
        self.work = ThreadPoolExecutor(max_workers=32, thread_name_prefix="picker-work")

    async def Process(self, request_iterator, context):
        peer, metrics = context.peer(), self.p.r.metrics
        try:
            self.streams.open(peer)
        except StreamRefused as e:
            metrics.refused("picker_" + e.reason)
            self.p.r.refusals.note("picker_" + e.reason, str(e))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        metrics.streams("picker", self.streams.total)
        loop = asyncio.get_running_loop()
        x = _Exchange()
        it = request_iterator.__aiter__()
        try:
            while True:
                try:
                    req = await asyncio.wait_for(it.__anext__(), self.limits.idle_timeout_s or None)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    metrics.idle_closed("picker")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, idle_message(self.limits.idle_timeout_s))
                answers = await loop.run_in_executor(self.work, lambda: list(self.p.handle(x, req)))
                for a in answers:
                    yield a
        except Refused as e:
            log.info("refused", extra={"fields": {"status": e.status, "path": x.path, "why": str(e)}})
            yield self.p._immediate(x, e.status, str(e), e.retry_after_s)
        finally:
            self.streams.close(peer)
            metrics.streams("picker", self.streams.total)
            self.p.finished(x)


def serve_picker(picker: EndpointPicker, port: int, host: str = "127.0.0.1", limits: StreamLimits | None = None):
    """The ext_proc gRPC server (``grpc.aio``: a gRPC model stream holds its ext_proc stream for its whole life, at
    the cost of a coroutine). Returns ``(server, bound port)``; ``server.stop(grace).wait(timeout)`` stops it."""
    limits = limits or PICKER_LIMITS
    service = PickerService(picker, limits)
    server = AioServer("picker-aio")
    server.on_stop.append(lambda: service.work.shutdown(wait=False, cancel_futures=True))

    def setup(s):
        ep_grpc.add_ExternalProcessorServicer_to_server(service, s)
        s.add_generic_rpc_handlers((grpc_health.aio_handler(lambda: bool(picker.r.available())),))

    bound = server.start(setup, f"{host}:{port}", limits.grpc_options())
    return server, bound
