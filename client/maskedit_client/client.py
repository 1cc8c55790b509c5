"""gRPC streaming client for the ``edit`` ensemble.

The ensemble contains a decoupled model, so Triton requires the bidirectional stream: one stream per
client carries any number of concurrent requests, matched back to their callers by request id.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

ImageLike = "str | Path | bytes | Image.Image | np.ndarray"
_CODE = re.compile(r"\b(INVALID_ARGUMENT|RESOURCE_EXHAUSTED|DEADLINE_EXCEEDED|CANCELLED|UNAVAILABLE|INTERNAL): ")
_FIELD = re.compile(r"^([A-Z_]+): ")
_TRITON_INVALID = re.compile(r"data-type is|expects|unexpected shape|missing required input|unexpected inference input"
                             r"|expected number of inputs|shape")
_TRITON_FIELD = re.compile(r"(?:input '|input\(s\) \[')([A-Za-z0-9_]+)'")
_REQUEST_ID = re.compile(r"request id: ([\w-]+)")
log = logging.getLogger("maskedit.client")


class EditError(Exception):
    """A failed edit. ``code`` is the status name (INVALID_ARGUMENT, ...), ``field`` the input at fault."""

    def __init__(self, message: str, code: str = "UNKNOWN", field: str | None = None):
        super().__init__(message)
        self.code, self.field = code, field

    @classmethod
    def from_server(cls, message: str) -> "EditError":
        m = _CODE.search(message)
        if not m:
            # Triton itself rejected the request before our models saw it: missing tensor, wrong dtype or shape.
            if _TRITON_INVALID.search(message):
                f = _TRITON_FIELD.search(message)
                return cls(message, "INVALID_ARGUMENT", f.group(1) if f else None)
            return cls(message, "UNKNOWN")
        rest = message[m.end():]
        f = _FIELD.match(rest)
        return cls(message[m.start():], m.group(1), f.group(1) if f else None)


@dataclass
class EditResult:
    png: bytes
    info: dict
    latency_s: float = 0.0
    progress: list = field(default_factory=list)

    @property
    def image(self) -> Image.Image:
        return Image.open(io.BytesIO(self.png))


def encode_image(image) -> bytes:
    """Bytes of an encoded image from a path, bytes, PIL image or HxW(x3) uint8 array."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, (str, Path)):
        return Path(image).read_bytes()
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"cannot encode {type(image).__name__} as an image")


def _bytes_input(name: str, value: bytes) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value], dtype=np.object_))
    return t


def _scalar_input(name: str, value, dtype: str, np_dtype) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], dtype)
    t.set_data_from_numpy(np.array([value], dtype=np_dtype))
    return t


class EditClient:
    """Thread-safe: ``edit`` may be called from many threads; ``submit`` returns a Future."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "edit", timeout_s: float = 600.0):
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self._client = grpcclient.InferenceServerClient(url, channel_args=[
            ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20),
            # an endpoint that restarts (the router, a server) is reconnected to within ~2 s, not minutes
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._pending: dict[str, tuple[Future, dict]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]  # request ids are unique across clients (cancel markers use them)
        self._stream_open = False
        self._stream_broken = False  # the stream ended with an error: the next submit opens a new one

    def _ensure_stream(self) -> None:
        with self._lock:
            if not self._stream_open:
                if self._stream_broken:  # its thread has ended (it reported the break): joined at once
                    self._client.stop_stream()
                    self._stream_broken = False
                self._client.start_stream(callback=self._on_response)
                self._stream_open = True

    def _on_response(self, result, error) -> None:
        # Runs on tritonclient's stream thread: an exception here would kill the stream for every request.
        try:
            self._handle(result, error)
        except Exception as e:  # a malformed response fails its own request only
            rid = result.get_response().id if result is not None else None
            with self._lock:
                entry = self._pending.pop(rid, None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(EditError(f"bad response from server: {e!r}", "INTERNAL"))

    def _handle(self, result, error) -> None:
        if error is not None:
            if getattr(error, "status", lambda: None)():  # the stream itself ended (a per-request error has none)
                self._stream_ended(error)
                return
            rid = self._error_request_id(error)
            with self._lock:
                entry = self._pending.pop(rid, None) if rid else None
                if entry is None and len(self._pending) == 1:  # ids are not echoed on some errors
                    entry = self._pending.pop(next(iter(self._pending)))
            if entry is not None:
                entry[0].set_exception(EditError.from_server(str(error.message() if hasattr(error, "message") else error)))
            else:
                log.warning("an error matched no pending request: %s", error)
            return
        resp = result.get_response()
        rid = resp.id
        final = resp.parameters.get("triton_final_response")
        final = bool(final and final.bool_param)
        with self._lock:
            entry = self._pending.get(rid)
        if entry is None:
            return
        fut, state = entry
        info_t = result.as_numpy("EDIT_INFO")
        if info_t is not None:
            info = json.loads(info_t.reshape(-1)[0])
            if isinstance(info.get("progress"), list):  # "step i of N" while denoising
                state.setdefault("progress", []).append(tuple(info["progress"]))
                if state.get("on_progress"):
                    state["on_progress"](*info["progress"])
            else:
                state["png"] = result.as_numpy("IMAGE").reshape(-1)[0]
                state["info"] = info
        if final:
            with self._lock:
                self._pending.pop(rid, None)
            if "png" in state:
                fut.set_result(EditResult(state["png"], state["info"], progress=state.get("progress", [])))
            else:
                fut.set_exception(EditError("stream ended without an image", "INTERNAL"))

    def _stream_ended(self, error) -> None:
        """The stream broke (the endpoint died or restarted): no answer will come on it, so every request pending
        on it fails now with the stream's status (UNAVAILABLE, ...); the next submit opens a new stream."""
        code = str(error.status()).replace("StatusCode.", "")
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            self._stream_open, self._stream_broken = False, True
        for fut, _ in pending:
            if not fut.done():
                fut.set_exception(EditError(f"{code}: the stream to {self.url} ended before the response arrived "
                                            f"({error.message()})", code))

    @staticmethod
    def _error_request_id(error) -> str | None:
        m = _REQUEST_ID.search(str(error))
        return m.group(1) if m else None

    def submit(self, template, mask, prompt: str, seed: int | None = None, steps: int | None = None,
               guidance: float | None = None, raw_output: bool = False, template_seed: int | None = None,
               use_cache: bool | None = None, register: bool = False, deadline_ms: int | None = None,
               on_progress: Callable[[int, int], None] | None = None, extra_inputs: list | None = None,
               negative_prompt: str | None = None) -> Future:
        """Send one edit; the Future resolves to an ``EditResult`` or raises ``EditError``.

        ``on_progress(step, steps)`` asks the server for per-step progress responses and is called for each.
        ``negative_prompt``: SD 2 / SDXL models (what to steer away from); Flux models refuse it."""
        inputs = [_bytes_input("TEMPLATE", encode_image(template)), _bytes_input("MASK", encode_image(mask)),
                  _bytes_input("PROMPT", prompt.encode() if isinstance(prompt, str) else prompt)]
        if negative_prompt is not None:
            inputs.append(_bytes_input("NEGATIVE_PROMPT", negative_prompt.encode()))
        if seed is not None:
            inputs.append(_scalar_input("SEED", seed, "INT64", np.int64))
        if steps is not None:
            inputs.append(_scalar_input("STEPS", steps, "INT32", np.int32))
        if guidance is not None:
            inputs.append(_scalar_input("GUIDANCE", guidance, "FP32", np.float32))
        if raw_output:
            inputs.append(_scalar_input("RAW_OUTPUT", True, "BOOL", np.bool_))
        if template_seed is not None:
            inputs.append(_scalar_input("TEMPLATE_SEED", template_seed, "INT64", np.int64))
        if use_cache is not None:
            inputs.append(_scalar_input("USE_CACHE", bool(use_cache), "BOOL", np.bool_))
        if register:
            inputs.append(_scalar_input("REGISTER", True, "BOOL", np.bool_))
        if deadline_ms is not None:
            inputs.append(_scalar_input("DEADLINE_MS", int(deadline_ms), "INT64", np.int64))
        if on_progress is not None:
            inputs.append(_scalar_input("PROGRESS", True, "BOOL", np.bool_))
        inputs += extra_inputs or []
        return self.submit_inputs(inputs, on_progress)

    def submit_inputs(self, inputs: list, on_progress=None) -> Future:
        """Send prepared ``InferInput``s (lets tests send malformed requests through the same path)."""
        self._ensure_stream()
        rid = f"{self._prefix}-{next(self._ids)}"
        fut: Future = Future()
        fut.request_id = rid
        with self._lock:
            self._pending[rid] = (fut, {"on_progress": on_progress})
        try:
            self._client.async_stream_infer(self.model, inputs, request_id=rid, enable_empty_final_response=True)
        except Exception as e:  # the stream broke just now: this request fails too, never hangs
            with self._lock:
                self._pending.pop(rid, None)
                self._stream_open, self._stream_broken = False, True
            if not fut.done():
                fut.set_exception(EditError(f"UNAVAILABLE: could not send the request: {e}", "UNAVAILABLE"))
        return fut

    def edit(self, template, mask, prompt: str, timeout_s: float | None = None, **kw) -> EditResult:
        """Edit ``template`` where ``mask`` is white; returns the PNG and the server's EDIT_INFO."""
        import time

        t0 = time.perf_counter()
        result = self.submit(template, mask, prompt, **kw).result(timeout=timeout_s or self.timeout_s)
        result.latency_s = time.perf_counter() - t0
        return result

    def register_template(self, template, prompt: str = "a photo", steps: int | None = None,
                          guidance: float | None = None, template_seed: int | None = None,
                          timeout_s: float | None = None) -> EditResult:
        """Warm the activation cache for ``template`` before traffic: runs the template once (no edit) and
        records its activations for the given steps/guidance/template seed. Later edits with the same
        settings compute only their masked tokens."""
        import numpy as _np
        from PIL import Image as _Image

        img = _Image.open(io.BytesIO(encode_image(template)))
        empty = _np.zeros((img.size[1], img.size[0]), _np.uint8)
        fut = self.submit(template, empty, prompt, steps=steps, guidance=guidance, template_seed=template_seed,
                          register=True)
        return fut.result(timeout=timeout_s or self.timeout_s)

    def cancel(self, *futures: Future) -> int:
        """Cancel submitted requests: the server drops them from its running batch at the next step.

        Triton 2.51 does not pass a client's cancel into a step of an ensemble, so this also calls the
        service's ``cancel`` model with the request ids. Returns how many the server marked."""
        ids = [getattr(f, "request_id", None) for f in futures]
        ids = [i for i in ids if i]
        if not ids:
            return 0
        try:
            t = grpcclient.InferInput("REQUEST_IDS", [len(ids)], "BYTES")
            t.set_data_from_numpy(np.array([i.encode() for i in ids], dtype=np.object_))
            n = int(self._client.infer("cancel", [t], client_timeout=10).as_numpy("CANCELLED")[0])
        except Exception:  # an endpoint without the cancel model: the stream cancel is all we have
            n = 0
        with self._lock:
            entries = [self._pending.pop(i, None) for i in ids]
        for entry in entries:
            if entry is not None and not entry[0].done():
                entry[0].set_exception(EditError("cancelled by the client", "CANCELLED"))
        return n

    def close(self) -> None:
        with self._lock:
            futs = [f for f, _ in self._pending.values()]
        if futs:
            self.cancel(*futs)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for fut, _ in pending:
            if not fut.done():
                fut.set_exception(EditError("client closed before the response arrived", "CANCELLED"))
        if self._stream_open or self._stream_broken:
            self._client.stop_stream(cancel_requests=True)
        self._client.close()

    def __enter__(self) -> "EditClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
