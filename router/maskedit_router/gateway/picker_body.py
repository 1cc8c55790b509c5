"""What the endpoint picker reads from a request body that a gateway forwards: the edit's features.

Two kinds of body reach a Triton pool through a gateway:
- gRPC (``content-type: application/grpc``): length-prefixed messages; the first of ``ModelInfer`` /
  ``ModelStreamInfer`` is a ``ModelInferRequest``. A gateway routes a whole HTTP/2 stream to one pod, so one
  decision per stream, made on its first request (clients wanting per-edit placement open a stream per edit);
- JSON for Triton's generate endpoints (``/v2/models/<model>/generate[_stream]``): the inputs by name, images in
  base64, complete at the end of the body.
Both become a ``ModelInferRequest`` for ``features.extract``, so the picker prices an edit exactly as the router
does. A body that cannot be read raises ``BadBody``. ``with_tenant``: a generate body naming the caller's tenant
(Triton does not forward headers to those endpoints; ``maskedit_common.tenant_wire``).
"""

from __future__ import annotations

import json
import re
import struct

from tritonclient.grpc import service_pb2

from maskedit_common.tenant_wire import HEADERS, TENANT_HEADER, WEIGHT_HEADER, weight_text
from maskedit_common.wire import maybe_base64

from ..placement.features import EditFeatures, extract

GRPC_PREFIX = 5  # 1 byte compressed flag, 4 bytes big-endian length
_GENERATE = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/generate(?:_stream)?/?(?:\?.*)?$")
_INFER_METHODS = ("/inference.GRPCInferenceService/ModelInfer", "/inference.GRPCInferenceService/ModelStreamInfer")
# JSON input name -> the tensor type the ensemble declares (the generate endpoint converts by the model's config)
_SCALARS = {"SEED": "int64_contents", "STEPS": "int_contents", "GUIDANCE": "fp32_contents",
            "TEMPLATE_SEED": "int64_contents", "STRENGTH": "fp64_contents", "PADDING_MASK_CROP": "int_contents"}
NO_WORK = EditFeatures(None, 0.0, 0, None)  # health, metadata and other calls that run no edit


class BadBody(ValueError):
    """The body is not what its path and content type say it is."""


def is_grpc(headers: dict) -> bool:
    return headers.get("content-type", "").startswith("application/grpc")


def first_grpc_message(body: bytes) -> bytes | None:
    """The first complete length-prefixed message of a gRPC body, None until it has all arrived."""
    if len(body) < GRPC_PREFIX:
        return None
    compressed, n = struct.unpack(">BI", body[:GRPC_PREFIX])
    if compressed:
        raise BadBody("compressed gRPC messages are not supported by the endpoint picker")
    if len(body) < GRPC_PREFIX + n:
        return None
    return body[GRPC_PREFIX:GRPC_PREFIX + n]


def grpc_features(path: str, message: bytes, resolution: int) -> EditFeatures:
    if path not in _INFER_METHODS:
        return NO_WORK
    try:
        req = service_pb2.ModelInferRequest.FromString(message)
    except Exception:  # protobuf's DecodeError and friends
        raise BadBody("the first gRPC message is not a ModelInferRequest") from None
    return _edit_features(req, resolution)


def json_features(path: str, body: bytes, resolution: int) -> EditFeatures:
    m = _GENERATE.match(path)
    if not m:
        return NO_WORK
    try:
        doc = json.loads(body or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadBody(f"request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadBody("request body must be a JSON object of input names to values")
    req = service_pb2.ModelInferRequest(model_name=m.group(1))
    for name in ("TEMPLATE", "MASK"):
        if isinstance(doc.get(name), str):
            t = req.inputs.add(name=name, datatype="BYTES", shape=[1])
            # the raw image, so a template's key is the same whichever protocol brought it
            t.contents.bytes_contents.append(maybe_base64(doc[name].encode())[0])
    loras = doc.get("LORAS")
    if loras is not None:  # JSON text, or the list itself
        t = req.inputs.add(name="LORAS", datatype="BYTES", shape=[1])
        t.contents.bytes_contents.append((loras if isinstance(loras, str) else json.dumps(loras)).encode())
    for name, kind in _SCALARS.items():
        v = doc.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            t = req.inputs.add(name=name, shape=[1])
            getattr(t.contents, kind).append(float(v) if kind.startswith("fp") else int(v))
    return _edit_features(req, resolution)


def with_tenant(path: str, body: bytes, tenant: str, weight: float) -> bytes | None:
    """``body`` of a generate request with the tenant's name and weight as top-level keys (``/generate`` makes
    every key that is no input a request parameter), over the client's own (top-level or under ``parameters``);
    None for other paths (Triton forwards the headers there). ``body`` was read by ``json_features`` already."""
    if not _GENERATE.match(path):
        return None
    doc = json.loads(body)
    nested = doc.get("parameters")
    if isinstance(nested, dict):
        for name in HEADERS:
            nested.pop(name, None)
    doc[TENANT_HEADER], doc[WEIGHT_HEADER] = tenant, weight_text(weight)
    return json.dumps(doc, separators=(",", ":")).encode()


def _edit_features(req, resolution: int) -> EditFeatures:
    if req.model_name != "edit":
        return NO_WORK
    return extract(req, resolution)
