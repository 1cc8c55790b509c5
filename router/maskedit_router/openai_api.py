"""OpenAI-compatible HTTP API in the router process: ``POST /v1/images/edits`` and ``GET /v1/models``.

Each edit becomes the same ``edit`` request a gRPC client sends, and goes to the router's own gRPC port over
loopback with the project's client: it gets exactly the routing, health checks and retries of any other request,
and the router needs no second code path. ``n`` edits of one call go out together on one stream with seeds
``seed .. seed + n - 1``; they share the template, so the router keeps them on one backend and all but the first
use (or follow) its cached activations. Form rules: ``openai_form``; error mapping: ``openai_errors``.

aiohttp serves it (its own event loop in a thread): multipart parsing with size limits built in, well kept.
Slow or idle clients are bounded (``limits.HttpLimits``): edits served at once (429 beyond), the time a body may
take to arrive (408), idle connections and unfinished request heads (closed); a client that disconnects cancels
its edits.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import threading
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from PIL import Image

from maskedit_client import EditClient, EditError

from .limits import HttpLimits
from .openai_errors import from_edit_error
from .openai_form import ApiError, EditJob, parse

log = logging.getLogger("maskedit.router.openai")
MAX_BODY_BYTES = 96 << 20  # a 4096x4096 template and its mask as PNG, with room


async def read_form(request: web.Request) -> dict:
    """Every field of a multipart/form-data body: file parts as bytes, the others as str (``image[]`` as a list)."""
    if not request.content_type.startswith("multipart/form-data"):
        raise ApiError(400, f"expected a multipart/form-data body, got {request.content_type or 'none'}", None,
                       "invalid_content_type")
    form: dict = {}
    try:
        reader = await request.multipart()
        async for part in reader:
            if not part.name:
                raise ApiError(400, "a form part has no name", None, "invalid_body")
            data = await part.read()
            value = bytes(data) if part.filename is not None else data.decode("utf-8", errors="strict")
            if part.name.endswith("[]"):
                form.setdefault(part.name, []).append(value)
            else:
                form[part.name] = value
    except (ValueError, HttpProcessingError) as e:  # a malformed multipart body (UnicodeDecodeError included)
        raise ApiError(400, f"could not read the multipart form: {getattr(e, 'message', None) or e}", None,
                       "invalid_body") from None
    return form


def _resized_png(png: bytes, size: tuple[int, int]) -> bytes:
    img = Image.open(io.BytesIO(png))
    buf = io.BytesIO()
    img.resize(size, Image.LANCZOS).save(buf, format="PNG")
    return buf.getvalue()


class OpenAIFrontend:
    """The aiohttp application over an ``EditClient`` (the router's gRPC address)."""

    def __init__(self, upstream: str, models: list[str] | None = None, timeout_s: float = 600.0,
                 limits: HttpLimits | None = None, metrics=None):
        self.client = EditClient(upstream, timeout_s=timeout_s)
        self.models = models or ["edit"]
        self.timeout_s = timeout_s
        self.limits, self.metrics = limits or HttpLimits(), metrics
        self.inflight = 0  # edits being served (one event loop: no lock)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._bounded])
        app.router.add_post("/v1/images/edits", self.edits)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.get_model)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        """Every error in OpenAI's shape, aiohttp's own (404, 405, 413) included."""
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            param = "image" if e.status == 413 else None
            return web.json_response(ApiError(e.status, e.reason if e.status != 413 else
                                              f"request body is above the limit of {MAX_BODY_BYTES} bytes",
                                              param, e.reason.lower().replace(" ", "_")).body(), status=e.status)

    @web.middleware
    async def _bounded(self, request, handler):
        """At most ``max_requests`` edits at once: one more is refused at once, before its body is read."""
        if request.path != "/v1/images/edits":
            return await handler(request)
        if self.inflight >= self.limits.max_requests:
            if self.metrics is not None:
                self.metrics.refused("http_busy")
            raise ApiError(429, f"the server is serving {self.inflight} edits, its limit (max_requests "
                                f"{self.limits.max_requests}); retry later", None, "server_busy")
        self.inflight += 1
        try:
            return await handler(request)
        finally:
            self.inflight -= 1

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "maskedit"}

    def _adapters(self) -> list[dict]:
        """The LoRA adapters of the configured library (``MASKEDIT_LORA_DIR``), as models whose parent is the base
        (vLLM lists its LoRA modules the same way)."""
        from maskedit_common.loras import library_names
        from maskedit_common.settings import load_settings

        try:
            names = library_names(load_settings().adapters)
        except Exception:
            return []
        return [{**self._model(n), "parent": self.models[0], "type": "lora"} for n in names]

    async def list_models(self, request):
        return web.json_response({"object": "list",
                                  "data": [self._model(m) for m in self.models] + self._adapters()})

    async def get_model(self, request):
        name = request.match_info["model"]
        if name not in self.models:
            raise ApiError(404, f"model: {name!r} does not exist; this server has {', '.join(self.models)}",
                           "model", "model_not_found")
        return web.json_response(self._model(name))

    async def edits(self, request):
        t0 = time.perf_counter()
        try:
            form = await asyncio.wait_for(read_form(request), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                                "(body_timeout_s)", None, "request_timeout") from None
        job = parse(form, self.models)
        futures = [self._submit(job, seed) for seed in job.seeds()]
        try:
            results = await asyncio.wait_for(asyncio.gather(*[asyncio.wrap_future(f) for f in futures]),
                                             self.timeout_s)
        except EditError as e:
            self._cancel(futures)
            raise from_edit_error(e.code, e.field, str(e)) from None
        except asyncio.TimeoutError:
            self._cancel(futures)
            raise ApiError(504, f"no answer within {self.timeout_s:.0f} s", None, "deadline_exceeded") from None
        except asyncio.CancelledError:  # the HTTP client went away: so do its edits
            self._cancel(futures)
            raise
        data = []
        for r in results:
            png = _resized_png(r.png, job.size) if job.size else r.png
            data.append({"b64_json": base64.b64encode(png).decode(), "revised_prompt": None, "edit_info": r.info})
        w, h = job.size or Image.open(io.BytesIO(results[0].png)).size
        log.info("openai edit", extra={"fields": {
            "n": job.n, "user": job.user, "size": f"{w}x{h}", "latency_s": round(time.perf_counter() - t0, 3),
            "cache": [r.info.get("cache") for r in results], "ignored": job.ignored}})
        return web.json_response({"created": int(time.time()), "data": data, "output_format": "png",
                                  "size": f"{w}x{h}"})

    def _submit(self, job: EditJob, seed):
        return self.client.submit(job.image, job.mask, job.prompt, seed=seed, steps=job.steps,
                                  guidance=job.guidance, template_seed=job.template_seed,
                                  deadline_ms=job.deadline_ms, use_cache=job.use_cache,
                                  negative_prompt=job.negative_prompt,
                                  loras=[(r.name, r.scale) for r in job.lora] or None)

    def _cancel(self, futures) -> None:
        pending = [f for f in futures if not f.done()]
        if pending:
            try:
                self.client.cancel(*pending)
            except Exception:  # best effort: the request is ending anyway
                log.exception("could not cancel abandoned edits")

    def close(self) -> None:
        self.client.close()


class OpenAIServer:
    """The frontend served on ``host:port`` from a thread with its own event loop; ``stop()`` ends both."""

    def __init__(self, upstream: str, port: int, host: str = "127.0.0.1", models: list[str] | None = None,
                 limits: HttpLimits | None = None, metrics=None):
        self.frontend = OpenAIFrontend(upstream, models, limits=limits, metrics=metrics)
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="router-openai")

    def start(self) -> "OpenAIServer":
        self._thread.start()
        self._started.wait(30)
        if self._error:
            raise self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = web.AppRunner(self.frontend.app(), access_log=None, handler_cancellation=True,
                                         keepalive_timeout=self.frontend.limits.keepalive_timeout_s)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # the bound port when 0 was asked
        except BaseException as e:  # reported to start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if self._runner is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self.frontend.close()
