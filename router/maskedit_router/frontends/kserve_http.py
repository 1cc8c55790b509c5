"""Triton's HTTP/REST protocol (KServe v2) on the router's HTTP port, beside ``/metrics`` and ``/health``.

Every call goes to the router's own gRPC port over loopback (as the OpenAI API does), so it gets exactly the routing,
health checks, admission and retries of a gRPC request; the router needs no second code path:

- ``GET /v2/health/live``, ``/v2/health/ready``, ``GET /v2`` (server metadata), ``GET /v2/models/{m}``
  (model metadata), ``/v2/models/{m}/ready``, ``/v2/models/{m}/config``;
- ``POST /v2/models/{m}/generate`` (Triton's generate extension: a JSON object of input name -> value, answered
  with the outputs by name) and ``/generate_stream`` (the same as server-sent events, one per response);
- ``POST /v2/models/{m}/infer``: KServe v2 inference, JSON tensors and Triton's binary tensor extension
  (``Inference-Header-Content-Length``; what ``perf_analyzer -i http`` sends). Triton serves a decoupled model such as
  ``edit`` only over the gRPC stream and generate; the router streams it and answers with its final response.
BYTES outputs that are not UTF-8 text (the PNG ``IMAGE``) come back in the binary extension; send ``TEMPLATE`` in
base64 (the backend then answers ``IMAGE`` in base64 too) to keep a JSON-only answer.
Edits served at once are bounded (``max_requests``): more are answered 429 at once.
"""

from __future__ import annotations

import json
import struct
import threading

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
NP = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
      "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16,
      "FP32": np.float32, "FP64": np.float64}
# an error text's code (Triton's own prefixes and the router's) -> HTTP status
STATUS = (("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503), ("DEADLINE_EXCEEDED", 504),
          ("NOT_FOUND", 404), ("CANCELLED", 499))


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def status_of(message: str, default: int = 400) -> int:
    for code, status in STATUS:
        if message.startswith(code) or f": {code}" in message[:80]:
            return status
    return default


def _bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _unbytes(raw: bytes) -> list[bytes]:
    out, i = [], 0
    while i + 4 <= len(raw):
        (n,) = struct.unpack("<I", raw[i:i + 4])
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def _flatten(data) -> list:
    if isinstance(data, list):
        return [x for d in data for x in _flatten(d)]
    return [data]


def _raw(datatype: str, values: list) -> bytes:
    if datatype == "BYTES":
        return _bytes_tensor([v if isinstance(v, bytes) else str(v).encode() for v in values])
    if datatype not in NP:
        raise HttpError(400, f"unsupported datatype {datatype}")
    return np.asarray(values, dtype=NP[datatype]).tobytes()


class KServeHttp:
    """The KServe v2 handlers over a blocking gRPC stub of the router's own port (``upstream``)."""

    def __init__(self, upstream: str, timeout_s: float = 600.0, max_requests: int = 64, metrics=None):
        self.channel = grpc.insecure_channel(upstream, options=[("grpc.max_send_message_length", 512 << 20),
                                                                ("grpc.max_receive_message_length", 512 << 20)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.timeout_s, self.metrics = timeout_s, metrics
        self.slots = threading.BoundedSemaphore(max_requests)
        self.max_requests = max_requests
        self._meta: dict = {}
        self._local = threading.local()

    def close(self) -> None:
        self.channel.close()

    # -- GET ----------------------------------------------------------------------------------------
    def get(self, path: str, md: tuple = ()) -> tuple[int, dict]:
        """``md``: the gRPC metadata to call with (the caller's ``authorization``)."""
        parts = [p for p in path.split("?")[0].split("/") if p]
        md = md or None
        try:
            if parts == ["v2", "health", "live"]:
                live = self.stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=5).live
                return (200 if live else 503), {}
            if parts == ["v2", "health", "ready"]:
                ready = self.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5).ready
                return (200 if ready else 503), {}
            if parts == ["v2"]:
                return 200, _dict(self.stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=10, metadata=md))
            if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
                name, version, rest = _model_path(parts[2:])
                if not rest:
                    return 200, _dict(self.stub.ModelMetadata(service_pb2.ModelMetadataRequest(
                        name=name, version=version), timeout=10, metadata=md))
                if rest == ["ready"]:
                    ready = self.stub.ModelReady(service_pb2.ModelReadyRequest(name=name, version=version),
                                                 timeout=10, metadata=md).ready
                    return (200 if ready else 400), {}
                if rest == ["config"]:
                    return 200, _dict(self.stub.ModelConfig(service_pb2.ModelConfigRequest(
                        name=name, version=version), timeout=10, metadata=md).config)
        except grpc.RpcError as e:
            return _grpc_status(e), {"error": e.details()}
        return 404, {"error": f"not found: {path}"}

    # -- POST ---------------------------------------------------------------------------------------
    def post(self, path: str, body: bytes, headers: dict, md: tuple = ()):
        """Returns ``(status, content_type, body bytes, extra headers)``, or for generate_stream ``(200, events)``
        where events is an iterator of SSE chunks. ``md``: the gRPC metadata to call with."""
        self._local.md = md or None  # per HTTP request (one thread each)
        parts = [p for p in path.split("?")[0].split("/") if p]
        if len(parts) == 5 and parts[:3] == ["v2", "repository", "models"] and parts[4] in ("load", "unload"):
            return self._repository(parts[3], parts[4])
        if len(parts) < 4 or parts[:2] != ["v2", "models"]:
            raise HttpError(404, f"not found: {path}")
        name, version, rest = _model_path(parts[2:])
        if rest == ["generate"]:
            req = self._generate_request(name, version, body)
            final = None
            for resp in self._stream(req):
                final = resp
            return 200, "application/json", json.dumps(self._generate_answer(final)).encode(), {}
        if rest == ["generate_stream"]:
            req = self._generate_request(name, version, body)
            return 200, self._events(req)
        if rest == ["infer"]:
            req, outputs_binary = self._infer_request(name, version, body, headers)
            final = None
            for resp in self._stream(req):
                final = resp
            return self._infer_answer(final, outputs_binary)
        raise HttpError(404, f"not found: {path}")

    def _repository(self, name: str, action: str):
        """Triton's model repository extension (admin keys only: ``admin_path``), forwarded to every backend."""
        try:
            if action == "load":
                self.stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name=name), timeout=120,
                                              metadata=self._local.md)
            else:
                self.stub.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(model_name=name),
                                                timeout=120, metadata=self._local.md)
        except grpc.RpcError as e:
            raise HttpError(_grpc_status(e), e.details() or e.code().name) from None
        return 200, "application/json", b"{}", {}

    def acquire(self) -> None:
        if not self.slots.acquire(blocking=False):
            if self.metrics is not None:
                self.metrics.refused("http_busy")
            raise HttpError(429, f"RESOURCE_EXHAUSTED: the router's HTTP port is serving {self.max_requests} "
                                 "requests, its limit; retry later")

    # -- requests -----------------------------------------------------------------------------------
    def metadata(self, name: str, version: str) -> dict:
        key = (name, version)
        if key not in self._meta:
            try:
                md = self.stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=name, version=version), timeout=10,
                                             metadata=getattr(self._local, "md", None))
            except grpc.RpcError as e:
                raise HttpError(_grpc_status(e), e.details()) from None
            self._meta[key] = {t.name: (t.datatype, list(t.shape)) for t in md.inputs}
        return self._meta[key]

    def _generate_request(self, name: str, version: str, body: bytes):
        try:
            doc = json.loads(body or b"{}")
        except ValueError as e:
            raise HttpError(400, f"the body is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise HttpError(400, "the body must be a JSON object of input name -> value")
        inputs = self.metadata(name, version)
        req = service_pb2.ModelInferRequest(model_name=name, model_version=version, id=str(doc.pop("id", "")))
        params = doc.pop("parameters", {}) or {}
        for k, v in doc.items():
            if k not in inputs:
                raise HttpError(400, f"INVALID_ARGUMENT: {k}: not an input of model '{name}' (its inputs: "
                                     f"{', '.join(inputs)})")
            datatype, _ = inputs[k]
            values = _flatten(v)
            t = req.inputs.add()
            t.name, t.datatype = k, datatype
            t.shape.append(len(values))
            req.raw_input_contents.append(_raw(datatype, values))
        _set_params(req, params)
        return req

    def _infer_request(self, name: str, version: str, body: bytes, headers: dict):
        header_len = headers.get("inference-header-content-length")
        n = int(header_len) if header_len else len(body)
        try:
            doc = json.loads(body[:n] or b"{}")
        except ValueError as e:
            raise HttpError(400, f"the inference header is not JSON: {e}") from None
        binary = body[n:]
        req = service_pb2.ModelInferRequest(model_name=name, model_version=version, id=str(doc.get("id", "")))
        offset = 0
        for inp in doc.get("inputs", []):
            t = req.inputs.add()
            t.name, t.datatype = inp["name"], inp["datatype"]
            t.shape.extend(int(x) for x in inp.get("shape", []))
            size = (inp.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                req.raw_input_contents.append(binary[offset:offset + int(size)])
                offset += int(size)
            else:
                req.raw_input_contents.append(_raw(t.datatype, _flatten(inp.get("data", []))))
        _set_params(req, doc.get("parameters") or {})
        outputs_binary = {o["name"]: bool((o.get("parameters") or {}).get("binary_data"))
                          for o in doc.get("outputs", [])}
        if (doc.get("parameters") or {}).get("binary_data_output"):
            outputs_binary["*"] = True
        for o in doc.get("outputs", []):
            req.outputs.add().name = o["name"]
        return req, outputs_binary

    def _stream(self, req):
        """The request through the router's stream; yields each response that carries outputs; raises HttpError
        on an error response."""
        req.parameters[EMPTY_FINAL].bool_param = True
        call = self.stub.ModelStreamInfer(iter([req]), timeout=self.timeout_s, metadata=getattr(self._local, "md", None))
        try:
            for resp in call:
                if resp.error_message:
                    raise HttpError(status_of(resp.error_message), resp.error_message)
                ir = resp.infer_response
                if ir.outputs:
                    yield ir
                if FINAL in ir.parameters and ir.parameters[FINAL].bool_param:
                    return
        except grpc.RpcError as e:
            raise HttpError(_grpc_status(e), e.details() or e.code().name) from None
        finally:
            call.cancel()

    def _events(self, req):
        try:
            for ir in self._stream(req):
                yield b"data: " + json.dumps(self._generate_answer(ir)).encode() + b"\n\n"
        except HttpError as e:
            yield b"data: " + json.dumps({"error": str(e)}).encode() + b"\n\n"

    # -- answers ------------------------------------------------------------------------------------
    @staticmethod
    def _outputs(ir) -> list[tuple[str, str, list, list]]:
        out = []
        for i, t in enumerate(ir.outputs):
            raw = ir.raw_output_contents[i] if i < len(ir.raw_output_contents) else b""
            values = _unbytes(raw) if t.datatype == "BYTES" else np.frombuffer(raw, NP[t.datatype]).tolist()
            out.append((t.name, t.datatype, list(t.shape), values))
        return out

    def _generate_answer(self, ir) -> dict:
        if ir is None:
            raise HttpError(500, "the model answered no outputs")
        doc = {"model_name": ir.model_name, "model_version": ir.model_version}
        if ir.id:
            doc["id"] = ir.id
        for name, datatype, _, values in self._outputs(ir):
            if datatype == "BYTES":
                values = [_text(v, name) for v in values]
            doc[name] = values[0] if len(values) == 1 else values
        return doc

    def _infer_answer(self, ir, outputs_binary: dict):
        if ir is None:
            raise HttpError(500, "the model answered no outputs")
        doc = {"model_name": ir.model_name, "model_version": ir.model_version, "outputs": []}
        if ir.id:
            doc["id"] = ir.id
        chunks = []
        for name, datatype, shape, values in self._outputs(ir):
            o = {"name": name, "datatype": datatype, "shape": shape}
            text = None
            if datatype == "BYTES" and not outputs_binary.get(name, outputs_binary.get("*")):
                try:
                    text = [v.decode("utf-8") for v in values]
                except UnicodeDecodeError:
                    text = None  # not text (a PNG): in the binary extension
            if datatype != "BYTES" and not outputs_binary.get(name, outputs_binary.get("*")):
                o["data"] = values
            elif text is not None:
                o["data"] = text
            else:
                blob = _bytes_tensor(values) if datatype == "BYTES" else np.asarray(values, NP[datatype]).tobytes()
                o["parameters"] = {"binary_data_size": len(blob)}
                chunks.append(blob)
            doc["outputs"].append(o)
        head = json.dumps(doc).encode()
        if not chunks:
            return 200, "application/json", head, {}
        return 200, "application/octet-stream", head + b"".join(chunks), {
            "Inference-Header-Content-Length": str(len(head))}


def _text(v: bytes, name: str) -> str:
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        raise HttpError(400, f"output {name} is binary: send TEMPLATE in base64 to have it answered in base64, "
                             "or use /infer (binary tensor extension)") from None


def _set_params(req, params: dict) -> None:
    for k, v in params.items():
        p = req.parameters[k]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            p.int64_param = v
        elif isinstance(v, float):
            p.double_param = v
        else:
            p.string_param = str(v)


def _model_path(parts: list[str]) -> tuple[str, str, list[str]]:
    name, rest = parts[0], parts[1:]
    version = ""
    if len(rest) >= 2 and rest[0] == "versions":
        version, rest = rest[1], rest[2:]
    return name, version, rest


def _dict(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _grpc_status(e: grpc.RpcError) -> int:
    return {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
            grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
            grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
            grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNIMPLEMENTED: 501}.get(e.code(), 400)
