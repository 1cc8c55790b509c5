"""gRPC streaming client for the ``edit`` ensemble: the stream, matching responses to requests, retries, cancel.

The ensemble contains a decoupled model, so Triton requires the bidirectional stream: one stream per
client carries any number of concurrent requests, matched back to their callers by request id. The request tensors
are built in ``inputs``, what a request ends in (``EditResult`` / ``EditError``) lives in ``results``.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

from . import reach
from .inputs import edit_inputs, encode_image, loras_json  # noqa: F401  (loras_json: importable from here too)
from .results import CODES, EditError, EditResult
from .retry import Backoff, Timer, retryable

ImageLike = "str | Path | bytes | Image.Image | np.ndarray"
_REQUEST_ID = re.compile(r"request id: ([\w-]+)")  # maskedit_common.request_id.PATTERN (a test holds them equal)
log = logging.getLogger("maskedit.client")
# Each request is stamped as it is sent, and again when it is retried (its DEADLINE_MS is then what is left): the
# server's bound counts from the stamp, not from when pre-processing got to it. The names and their meaning are the
# backend's (``maskedit_common.sent_stamp``; a test holds them equal): the time, and this host's boot id (which
# clock it is: the server reads a stamp of its own host exactly).
SENT_AT, SENT_CLOCK = "maskedit_sent_at", "maskedit_sent_clock"


def _host_clock() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class EditClient:
    """Thread-safe: ``edit`` may be called from many threads; ``submit`` returns a Future.

    A request that fails with UNAVAILABLE before any response came for it (the endpoint restarted, its stream broke,
    no backend was up) is sent again on a new stream after ``backoff``, until its deadline (``deadline_ms`` if
    given, else ``timeout_s`` from its submission): a router restart costs latency, not errors. ``retry=False``:
    such a request fails at once.

    ``api_key``: sent as ``authorization: Bearer <key>`` metadata on every call (a router with a key file);
    ``ca_file``: TLS to the endpoint, trusting the certificates in that PEM file (``tls=True`` without one: the
    system's trusted roots); ``headers``: more metadata for every call (e.g. a guarded backend's key, for tools that
    call a backend directly: docs/security.md).

    ``connect_timeout_s``: how long a request waits for the client's first connection (or less, its deadline); without
    one it fails then with ``UNAVAILABLE`` saying the likely cause (nothing listening at ``url``, ...: ``reach``),
    instead of being retried until its deadline. Once a connection was made, the endpoint's going away is retried as
    above."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "edit", timeout_s: float = 600.0,
                 retry: bool = True, backoff: Backoff = Backoff(), api_key: str | None = None,
                 ca_file: str | Path | None = None, tls: bool = False, connect_timeout_s: float = 5.0,
                 headers: dict | None = None):
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.connect_timeout_s, self._tls = connect_timeout_s, bool(ca_file) or tls
        self._reached = False  # a connection was made once: from then on a broken one is a restart, retried
        self._reach_lock = threading.Lock()
        self._awaiting: dict[str, float] = {}  # request id -> when it gives up waiting for a first connection
        self._connector: threading.Thread | None = None
        self._closed = False
        self.retry, self.backoff = retry, backoff
        self._headers = {**(headers or {}), **({"authorization": f"Bearer {api_key}"} if api_key else {})} or None
        self._client = grpcclient.InferenceServerClient(url, ssl=bool(ca_file) or tls,
                                                        root_certificates=str(ca_file) if ca_file else None,
                                                        channel_args=[
            ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20),
            # an endpoint that restarts (the router, a server) is reconnected to within ~2 s, not minutes
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._pending: dict[str, tuple[Future, dict]] = {}
        self._retrying: dict[str, tuple[Future, dict]] = {}  # waiting out a backoff before being sent again
        self._timer = Timer("maskedit-client-retry")
        self._lock = threading.Lock()
        self._stream_lock = threading.Lock()  # opening a stream; never taken on the stream's own thread
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]  # request ids are unique across clients (cancel markers use them)
        self._stream_open = False
        self._stream_broken = False  # the stream ended with an error: the next submit opens a new one
        self._stream_refusal: EditError | None = None  # how the stream ended: its status (a refused key?)
        self._stream_end = threading.Event()  # set when the open stream's end (and its status) has arrived
        self._clock = _host_clock()

    def _ensure_stream(self) -> None:
        # Not under self._lock: stop_stream joins the broken stream's thread, which may still be handing its
        # requests over (under self._lock) to be retried.
        with self._stream_lock:
            with self._lock:
                if self._stream_open:
                    return
                broken = self._stream_broken
            if broken:  # its thread has ended or is ending (it reported the break)
                self._client.stop_stream()
            with self._lock:
                self._stream_refusal = None
            self._stream_end.clear()
            self._client.start_stream(callback=self._on_response, headers=self._headers)
            with self._lock:
                self._stream_open, self._stream_broken = True, False

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
                self._failed(rid or entry[0].request_id, *entry,
                             EditError.from_server(str(error.message() if hasattr(error, "message") else error)))
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
        state["responded"] = True  # never replayed from now on: its caller may have seen part of it
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
            pending, self._pending = list(self._pending.items()), {}
            self._stream_open, self._stream_broken = False, True
            # the stream's own status (no or a wrong API key, a restricted protocol): what a send racing the end
            # reports too, rather than tritonclient's "no longer in valid state"
            self._stream_refusal = EditError(f"{code}: {error.message()}", code)
        self._stream_end.set()
        for rid, (fut, state) in pending:
            self._failed(rid, fut, state, EditError(f"{code}: the stream to {self.url} ended before the response "
                                                    f"arrived ({error.message()})", code))

    def _failed(self, rid: str, fut: Future, state: dict, error: EditError) -> None:
        """``rid`` failed: sent again after a backoff if the rule allows it (``retry.retryable``) and its deadline
        leaves time, else its Future fails."""
        if fut.done():
            return
        delay = None
        # Triton 2.51's Python backend has no RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED: a full queue answers
        # "UNAVAILABLE: RESOURCE_EXHAUSTED: ..." (read with the inner name as the field). The inner name is meant:
        # a refusal is an answer, never retried.
        code = error.field if error.field in CODES else error.code
        if self.retry and "inputs" in state and retryable(code, state.get("responded", False)):
            delay = self.backoff.next(state["attempt"], state["deadline"], time.monotonic())
        if delay is None:
            fut.set_exception(error)
            return
        state["attempt"] += 1
        with self._lock:
            self._retrying[rid] = (fut, state)
        log.info("retrying %s in %.2f s (attempt %d): %s", rid, delay, state["attempt"], error)
        self._timer.call_later(delay, lambda: self._resend(rid))

    def _await_connection(self, rid: str, fut: Future, state: dict) -> None:
        """Park ``rid`` until the first connection (as a retry waiting out its backoff is parked: cancel and close
        find it); it gives up at ``connect_timeout_s`` after submission or at its deadline, whichever is first."""
        with self._lock:
            self._retrying[rid] = (fut, state)
        with self._reach_lock:
            self._awaiting[rid] = min(time.monotonic() + self.connect_timeout_s, state["deadline"])
            if self._connector is None:
                self._connector = threading.Thread(target=self._connect, name="maskedit-client-connect", daemon=True)
                self._connector.start()

    def _connect(self) -> None:
        """The connector thread: waits for the channel's first connection in short slices; sends the parked
        requests once connected, fails those whose wait ran out with the likely cause (``reach``)."""
        while True:
            try:  # tritonclient keeps its channel private; waiting on it connects the channel the stream then uses
                connected = not self._closed and reach.connected(self._client._channel, 0.25)
            except ValueError:  # closed meanwhile
                connected = False
            now = time.monotonic()
            with self._reach_lock:
                self._reached = self._reached or connected
                if self._closed:  # close() fails what is parked
                    ready, expired, self._awaiting = [], [], {}
                elif connected:
                    ready, expired, self._awaiting = list(self._awaiting), [], {}
                else:
                    ready, expired = [], [r for r, t in self._awaiting.items() if now >= t]
                    for r in expired:
                        del self._awaiting[r]
                finished = not self._awaiting
                if finished:
                    self._connector = None
            for r in ready:
                self._resend(r)
            if expired:
                why = reach.likely_cause(self.url, self.connect_timeout_s, self._tls)
                error = EditError(f"UNAVAILABLE: cannot reach {self.url}: {why}", "UNAVAILABLE")
                for r in expired:
                    with self._lock:
                        entry = self._retrying.pop(r, None)
                    if entry is not None and not entry[0].done():
                        entry[0].set_exception(error)  # never retried: nothing was ever there to come back
            if finished:
                return

    def _resend(self, rid: str) -> None:
        with self._lock:
            entry = self._retrying.pop(rid, None)
        if entry is None or entry[0].done():  # cancelled or closed meanwhile
            return
        fut, state = entry
        left_ms = int((state["deadline"] - time.monotonic()) * 1000)
        for t in state["inputs"]:
            if t.name() == "DEADLINE_MS":  # relative to its arrival: what is left of it
                t.set_data_from_numpy(np.array([max(1, left_ms)], dtype=np.int64))
        self._send(rid, fut, state)

    @staticmethod
    def _error_request_id(error) -> str | None:
        m = _REQUEST_ID.search(str(error))
        return m.group(1) if m else None

    def submit(self, template, mask, prompt: str, seed: int | None = None, steps: int | None = None,
               guidance: float | None = None, raw_output: bool = False, template_seed: int | None = None,
               use_cache: bool | None = None, register: bool = False, deadline_ms: int | None = None,
               on_progress: Callable[[int, int], None] | None = None, extra_inputs: list | None = None,
               negative_prompt: str | None = None, loras=None, controls=None, control_images=None,
               temporal=None, reference_images=None, strength: float | None = None,
               padding_mask_crop: int | None = None, guidance_rescale: float | None = None,
               true_cfg_scale: float | None = None, output_format: str | None = None,
               output_quality: int | None = None) -> Future:
        """Send one edit; the Future resolves to an ``EditResult`` or raises ``EditError``.

        ``on_progress(step, steps)`` asks the server for per-step progress responses and is called for each.
        ``negative_prompt``: SD 2 / SDXL models (what to steer away from); Flux models refuse it.
        ``loras``: LoRA adapters from the server's library: ``[("name", 0.8), ...]``, ``{"name": scale}``, a list of
        ``{"name", "scale"}`` objects or the JSON text of one (sent as ``LORAS``).
        ``controls``: ControlNets from the server's library, ``[("name", scale[, start, end]), ...]`` or
        ``{"name", "scale", "start", "end", "mode", "preprocess"}`` objects (sent as ``CONTROLS``), with
        ``control_images`` one image each, in order (paths, bytes or PIL images; sent as ``CONTROL_IMAGES``).
        ``temporal``: temporal reuse, e.g. ``{"policy": "fbcache", "threshold": 0.08}`` or its JSON text (sent as
        ``TEMPORAL``; docs/caching.md); None: the server's default.
        ``reference_images``: in-context edit models (FLUX.2 [klein], FLUX.1 Kontext): images the edit conditions on
        beside the template, the stock pipeline's ``image_reference`` (paths, bytes or PIL images; sent as
        ``REFERENCE_IMAGES``).
        The stock inpainting pipelines' own parameters keep their Diffusers names (docs/api.md): ``strength``,
        ``padding_mask_crop``, ``guidance_rescale``, ``true_cfg_scale``; ``output_format`` (png, jpeg, webp:
        ``EditResult.png`` then holds those bytes) and ``output_quality`` (jpeg, webp)."""
        inputs = edit_inputs(template, mask, prompt, seed=seed, steps=steps, guidance=guidance,
                             raw_output=raw_output, template_seed=template_seed, use_cache=use_cache,
                             register=register, deadline_ms=deadline_ms, progress=on_progress is not None,
                             negative_prompt=negative_prompt, loras=loras, controls=controls,
                             control_images=control_images, temporal=temporal,
                             reference_images=reference_images, strength=strength,
                             padding_mask_crop=padding_mask_crop, guidance_rescale=guidance_rescale,
                             true_cfg_scale=true_cfg_scale, output_format=output_format,
                             output_quality=output_quality)
        inputs += extra_inputs or []
        return self.submit_inputs(inputs, on_progress, None if deadline_ms is None else
                                  min(self.timeout_s, deadline_ms / 1000))

    def submit_inputs(self, inputs: list, on_progress=None, deadline_s: float | None = None) -> Future:
        """Send prepared ``InferInput``s (lets tests send malformed requests through the same path).
        ``deadline_s``: how long it may be retried (default ``timeout_s``)."""
        rid = f"{self._prefix}-{next(self._ids)}"
        fut: Future = Future()
        fut.request_id = rid
        state = {"on_progress": on_progress, "inputs": inputs, "attempt": 0,
                 "deadline": time.monotonic() + (self.timeout_s if deadline_s is None else deadline_s)}
        self._send(rid, fut, state)
        return fut

    def _send(self, rid: str, fut: Future, state: dict) -> None:
        if not self._reached:  # no connection made yet: the connector sends it once there is one
            self._await_connection(rid, fut, state)
            return
        try:
            self._ensure_stream()
            with self._lock:
                self._pending[rid] = (fut, state)
            self._client.async_stream_infer(self.model, state["inputs"], request_id=rid,
                                            enable_empty_final_response=True,
                                            parameters={SENT_AT: time.time(), SENT_CLOCK: self._clock})
        except Exception as e:  # the stream broke just now: this request fails or is retried, never hangs
            with self._lock:
                self._pending.pop(rid, None)
                self._stream_open, self._stream_broken = False, True
            # the stream's own end (its status: a refused key?) may arrive a moment later on a busy host
            self._stream_end.wait(2.0)
            with self._lock:
                refusal = self._stream_refusal
            self._failed(rid, fut, state, refusal or EditError(f"UNAVAILABLE: could not send the request: {e}",
                                                               "UNAVAILABLE"))

    def edit(self, template, mask, prompt: str, timeout_s: float | None = None, **kw) -> EditResult:
        """Edit ``template`` where ``mask`` is white; returns the PNG and the server's EDIT_INFO."""
        t0 = time.perf_counter()
        result = self.submit(template, mask, prompt, **kw).result(timeout=timeout_s or self.timeout_s)
        result.latency_s = time.perf_counter() - t0
        return result

    def register_template(self, template, prompt: str = "a photo", steps: int | None = None,
                          guidance: float | None = None, template_seed: int | None = None,
                          timeout_s: float | None = None, strength: float | None = None, mask=None,
                          padding_mask_crop: int | None = None, reference_images=None) -> EditResult:
        """Warm the activation cache for ``template`` before traffic: runs the template once (no edit) and
        records its activations for the given steps/guidance/template seed. Later edits with the same
        settings compute only their masked tokens. ``strength``: for models whose entries are keyed on it
        (Flux Fill, SD 2 / SDXL: docs/caching.md, "Strength"); ``mask`` + ``padding_mask_crop``: an entry for the
        crop the edits with that mask will use (the mask's own tokens are recorded as edited); ``reference_images``:
        an in-context edit model's entry for edits with these reference images (they are in the key)."""
        if mask is None:
            img = Image.open(io.BytesIO(encode_image(template)))
            mask = np.zeros((img.size[1], img.size[0]), np.uint8)
        fut = self.submit(template, mask, prompt, steps=steps, guidance=guidance, template_seed=template_seed,
                          register=True, strength=strength, padding_mask_crop=padding_mask_crop,
                          reference_images=reference_images)
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
            n = int(self._client.infer("cancel", [t], client_timeout=10, headers=self._headers)
                    .as_numpy("CANCELLED")[0])
        except Exception:  # an endpoint without the cancel model: the stream cancel is all we have
            n = 0
        with self._lock:
            entries = [self._pending.pop(i, None) or self._retrying.pop(i, None) for i in ids]
        for entry in entries:
            if entry is not None and not entry[0].done():
                entry[0].set_exception(EditError("cancelled by the client", "CANCELLED"))
        return n

    def close(self) -> None:
        with self._reach_lock:
            self._closed = True  # the connector stops at its next slice; its parked requests fail below
        with self._lock:
            futs = [f for f, _ in self._pending.values()]
            waiting, self._retrying = list(self._retrying.values()), {}
        if futs:
            self.cancel(*futs)
        with self._lock:
            pending, self._pending = list(self._pending.values()) + waiting, {}
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

