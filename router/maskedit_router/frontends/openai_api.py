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

from ..access.auth import Forbidden, Keyring, Unauthenticated, bearer
from ..access.limits import HttpLimits
from ..access.tenancy import retry_after
from . import client_gone
from .lora_admin import AdapterAdmin, AdminError
from .openai_errors import from_edit_error
from .openai_form import ApiError, EditJob, parse

log = logging.getLogger("maskedit.router.openai")
MAX_BODY_BYTES = 96 << 20  # a 4096x4096 template and its mask as PNG, with room
# routes that change the served set: admin keys only (the LoRA adapter endpoints vLLM names so)
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
TENANT = web.RequestKey("tenant", object)  # the request's auth.Tenant
API_KEY = web.RequestKey("api_key", object)  # its key, carried to the gRPC port (None: open mode)
MAX_CLIENTS = 256  # upstream clients kept, one per API key in use (each carries its key to the gRPC port)


async def read_form(request: web.Request) -> dict:
    """Every field of a multipart/form-data body: file parts as bytes, the others as str; a field named ``...[]`` or
    sent more than once as a list of its values, in order."""
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
            if part.name.endswith("[]") or part.name in form:  # a list, or a field sent again (the openai
                prev = form.get(part.name, [])                  # package's ``controls[][name]`` per object)
                form[part.name] = [*(prev if isinstance(prev, list) else [prev]), value]
            else:
                form[part.name] = value
    except (ValueError, HttpProcessingError) as e:  # a malformed multipart body (UnicodeDecodeError included)
        raise ApiError(400, f"could not read the multipart form: {getattr(e, 'message', None) or e}", None,
                       "invalid_body") from None
    return form


def _resized(data: bytes, size: tuple[int, int], fmt: str = "png", quality: int = 95) -> bytes:
    """The result at the form's ``size``, encoded again as the backend encoded it (``output_format``)."""
    img = Image.open(io.BytesIO(data))
    buf = io.BytesIO()
    save = {"png": ("PNG", {}), "jpeg": ("JPEG", {"quality": quality}), "webp": ("WEBP", {"quality": quality})}
    name, kw = save.get(fmt, save["png"])
    img.resize(size, Image.LANCZOS).save(buf, format=name, **kw)
    return buf.getvalue()


class OpenAIFrontend:
    """The aiohttp application over an ``EditClient`` (the router's gRPC address)."""

    def __init__(self, upstream: str, models: list[str] | None = None, timeout_s: float = 600.0,
                 limits: HttpLimits | None = None, metrics=None, keyring: Keyring | None = None,
                 admin: AdapterAdmin | None = None):
        self.upstream = upstream
        self.keyring = keyring or Keyring()
        self.client = EditClient(upstream, timeout_s=timeout_s)  # open mode: no key to carry
        self._clients: dict[str, EditClient] = {}  # API key -> its client (insertion order: oldest first)
        self.models = models or ["edit"]
        self.timeout_s = timeout_s
        self.limits, self.metrics = limits or HttpLimits(), metrics
        self.inflight = 0  # edits being served (one event loop: no lock)
        self._admin = admin

    @property
    def admin(self) -> AdapterAdmin:
        """Runtime adapter loading into the configured library (``lora_admin``), from the settings by default."""
        if self._admin is None:
            from maskedit_common.settings import load_settings

            s = load_settings()
            self._admin = AdapterAdmin(s.adapters, s.lora_roots, reserved=self.models)
        return self._admin

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._auth, self._bounded])
        app.router.add_post("/v1/images/edits", self.edits)
        for path in ADMIN_PATHS:
            app.router.add_post(path, self.adapters)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.get_model)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        """Every error in OpenAI's shape, aiohttp's own (404, 405, 413) included. A client that went away mid-request
        cancels its handler (its edits are cancelled with it): counted, one line."""
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if request.transport is None or request.transport.is_closing():
                client_gone.note(self.metrics, "openai", request.path, "cancelled")
            raise
        except client_gone.DISCONNECTS as e:  # gone while its body was read: nobody to answer (nginx's 499)
            client_gone.note(self.metrics, "openai", request.path, e)
            return web.Response(status=499, reason="Client Closed Request")
        except ApiError as e:
            hint = retry_after(e.message) if e.status == 429 else None
            headers = {"Retry-After": hint} if hint else {}
            if e.status == 401:
                headers["WWW-Authenticate"] = "Bearer"
            return web.json_response(e.body(), status=e.status, headers=headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            param = "image" if e.status == 413 else None
            return web.json_response(ApiError(e.status, e.reason if e.status != 413 else
                                              f"request body is above the limit of {MAX_BODY_BYTES} bytes",
                                              param, e.reason.lower().replace(" ", "_")).body(), status=e.status)

    @web.middleware
    async def _auth(self, request, handler):
        """Every route needs a key when there is a key file (as vLLM's ``--api-key``); admin routes an admin key."""
        value = request.headers.get("Authorization")
        try:
            tenant = self.keyring.check(value, admin=request.path in ADMIN_PATHS)
        except Unauthenticated as e:
            if self.metrics is not None:
                self.metrics.auth_failed("openai", "unauthenticated")
            raise ApiError(401, str(e), None, "invalid_api_key") from None
        except Forbidden as e:
            if self.metrics is not None:
                self.metrics.auth_failed("openai", "forbidden")
            raise ApiError(403, str(e), None, "insufficient_permissions") from None
        request[TENANT] = tenant
        request[API_KEY] = bearer(value) if self.keyring.enabled else None
        return await handler(request)

    def client_for(self, api_key: str | None) -> EditClient:
        """The upstream client carrying ``api_key`` to the router's gRPC port (its limits and fair share apply
        there, as to any gRPC caller)."""
        if api_key is None:
            return self.client
        c = self._clients.pop(api_key, None)
        if c is None:
            c = EditClient(self.upstream, timeout_s=self.timeout_s, api_key=api_key)
            while len(self._clients) >= MAX_CLIENTS:  # the least recently used goes (its edits have ended)
                old = self._clients.pop(next(iter(self._clients)))
                threading.Thread(target=_close_later, args=(old, self.timeout_s), daemon=True).start()
        self._clients[api_key] = c  # most recently used last
        return c

    async def adapters(self, request):
        """``/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``/v1/unload_lora_adapter``
        ``{"lora_name"}`` (vLLM's names and bodies): admin keys only (``_auth``). The adapter is installed into
        (removed from) the library every backend reads (``lora_admin``), off the event loop: a copy can be large."""
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be JSON", None, "invalid_body") from None
        op = self.admin.load if request.path.endswith("/load_lora_adapter") else self.admin.unload
        try:
            out = await asyncio.to_thread(op, body)
        except AdminError as e:
            code = {400: "invalid_lora_adapter", 404: "lora_adapter_not_found"}.get(e.status, "lora_library_error")
            raise ApiError(e.status, str(e), e.param, code) from None
        log.info("lora adapter", extra={"fields": {**out, "op": request.path.rsplit("/", 1)[-1],
                                                   "tenant": request[TENANT].name}})
        return web.json_response(out)

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

        try:
            names = library_names(self.admin.library)
        except Exception:
            return []
        return [{**self._model(n), "parent": self.models[0], "type": "lora"} for n in names]

    def _controlnets(self) -> list[dict]:
        """The ControlNets of the configured library (``MASKEDIT_CONTROLNET_DIR``), listed the same way: names a
        request's ``controls`` may use."""
        from maskedit_common.controls import library_names
        from maskedit_common.settings import load_settings

        try:
            names = library_names(load_settings().controlnets)
        except Exception:
            return []
        return [{**self._model(n), "parent": self.models[0], "type": "controlnet"} for n in names]

    async def list_models(self, request):
        return web.json_response({"object": "list",
                                  "data": [self._model(m) for m in self.models] + self._adapters()
                                  + self._controlnets()})

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
        client = self.client_for(request.get(API_KEY))
        futures = [self._submit(client, job, seed) for seed in job.seeds()]
        try:
            results = await asyncio.wait_for(asyncio.gather(*[asyncio.wrap_future(f) for f in futures]),
                                             self.timeout_s)
        except EditError as e:
            self._cancel(client, futures)
            raise from_edit_error(e.code, e.field, str(e)) from None
        except asyncio.TimeoutError:
            self._cancel(client, futures)
            raise ApiError(504, f"no answer within {self.timeout_s:.0f} s", None, "deadline_exceeded") from None
        except asyncio.CancelledError:  # the HTTP client went away: so do its edits
            self._cancel(client, futures)
            raise
        data = []
        for r in results:
            fmt = job.output_format or "png"
            out = _resized(r.png, job.size, fmt, job.output_quality or 95) if job.size else r.png
            data.append({"b64_json": base64.b64encode(out).decode(), "revised_prompt": None, "edit_info": r.info})
        w, h = job.size or Image.open(io.BytesIO(results[0].png)).size
        log.info("openai edit", extra={"fields": {
            "n": job.n, "user": job.user, "tenant": request[TENANT].name, "size": f"{w}x{h}", "latency_s": round(time.perf_counter() - t0, 3),
            "cache": [r.info.get("cache") for r in results], "ignored": job.ignored}})
        return web.json_response({"created": int(time.time()), "data": data,
                                  "output_format": job.output_format or "png", "size": f"{w}x{h}"})

    def _submit(self, client: EditClient, job: EditJob, seed):
        return client.submit(job.image, job.mask, job.prompt, seed=seed, steps=job.steps,
                                  guidance=job.guidance, template_seed=job.template_seed,
                                  deadline_ms=job.deadline_ms, use_cache=job.use_cache,
                                  negative_prompt=job.negative_prompt,
                                  loras=[(r.name, r.scale) for r in job.lora] or None,
                                  controls=[c.as_dict() for c in job.controls] or None,
                                  control_images=job.control_images or None, temporal=job.temporal,
                                  reference_images=job.reference_images or None,
                                  strength=job.strength, padding_mask_crop=job.padding_mask_crop,
                                  guidance_rescale=job.guidance_rescale, true_cfg_scale=job.true_cfg_scale,
                                  output_format=job.output_format, output_quality=job.output_quality)

    def _cancel(self, client: EditClient, futures) -> None:
        pending = [f for f in futures if not f.done()]
        if pending:
            try:
                client.cancel(*pending)
            except Exception:  # best effort: the request is ending anyway
                log.exception("could not cancel abandoned edits")

    def close(self) -> None:
        self.client.close()
        for c in list(self._clients.values()):
            c.close()


def _close_later(client: EditClient, after_s: float) -> None:
    """Close an evicted client once its edits can have ended."""
    time.sleep(min(after_s, 60.0))
    client.close()


class OpenAIServer:
    """The frontend served on ``host:port`` from a thread with its own event loop; ``stop()`` ends both."""

    def __init__(self, upstream: str, port: int, host: str = "127.0.0.1", models: list[str] | None = None,
                 limits: HttpLimits | None = None, metrics=None, keyring: Keyring | None = None, ssl_context=None,
                 admin: AdapterAdmin | None = None):
        self.frontend = OpenAIFrontend(upstream, models, limits=limits, metrics=metrics, keyring=keyring,
                                       admin=admin)
        self.ssl_context = ssl_context
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
            site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
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
