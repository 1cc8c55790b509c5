"""`python -m maskedit_router`: the mask-aware router in front of Triton instances.

    python -m maskedit_router --backends 127.0.0.1:8001,127.0.0.1:9001 --port 7001 --http-port 7002
    python -m maskedit_router --backends-file backends.txt   # one host:port a line, re-read every 5 s
    python -m maskedit_router --backends-dns triton-headless.ns.svc:8001   # every address of a headless Service
    python -m maskedit_router ... --ext-proc-port 9002 --target-port 8001   # also a GIE endpoint picker
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import service_pb2_grpc

from maskedit_common import backend_guard
from maskedit_common.cost_model import CostModel
from maskedit_common.logs import JsonFormatter
from maskedit_common.settings import SERVING_DEFAULTS_FILE, load_settings

from .access.auth import Keyring
from .access.limits import HttpLimits, StreamLimits
from .access.tenancy import FairQueue
from .access.tls import TlsFiles, handshake_failed
from .frontends.http_port import serve_http
from .frontends.kserve_http import KServeHttp
from .frontends.openai_api import OpenAIServer
from .gateway.picker import PICKER_LIMITS, EndpointPicker, serve_picker
from .placement import policies
from .placement.features import MASK_RATIOS
from .proxy import discovery
from .proxy.admission import AdmissionWatcher
from .proxy.aio import AioServer, RouterService
from .proxy.backend import CHANNEL_OPTIONS
from .proxy.health import HealthChecker
from .proxy.server import Router

PROFILED_MODEL = "bench-flux-fill"  # the model whose CPU profile is shipped: the last resort
# The fair queue's refusal text when no backend is up: its slots are then held by requests sitting out the router's
# retry budget, so "a busy queue" alone would point the caller at the wrong cause.
NO_BACKEND_HOLDS_SLOTS = "no backend is healthy: the slots are held by requests waiting for one"


def default_profile() -> Path:
    """The cost profile the router predicts with, found as the backends find theirs (the same settings):
    ``MASKEDIT_COST_PROFILE`` if set; else the served model's (``MASKEDIT_MODEL_DIR``'s name) in the profiles
    directory, a GPU's before the CPU's; else the benchmark model's CPU profile, which ships with the project (the
    online refit then scales it to what the backends take)."""
    s = load_settings()
    if s.cost_profile:
        return Path(s.cost_profile)
    name = Path(s.model_dir).name
    for path in [*sorted(s.profiles.glob(f"cost_model_{name}_*.json")), s.profile_path("cpu", name)]:
        if path.exists():
            return path
    return s.profile_path("cpu", PROFILED_MODEL)


def build(addrs, policy="predicted", profile: Path | None = None, resolution: int | None = None,
          admission_wait_s: float = 0.6, retry_budget_s: float = 30.0, load_factor: float = 1.25,
          vnodes: int = 100, weights: dict | None = None, mem_templates: int = 16, disk_templates: int = 64,
          lora_load_ms: float = policies.LORA_LOAD_MS, max_inflight: int = 256, max_inflight_per_backend: int = 32,
          backend_key: str | None = None, mask_threshold: int | None = None):
    """A router over ``addrs``. The cost model is the served model's calibration profile; ``resolution`` (the
    model's working resolution, default: the profiled model's settings, else Flux's 1024) sets the token grid
    masks are measured on; ``admission_wait_s`` is the longest an edit may wait in front of a backend's admission
    check (``proxy.admission``; 0: off); ``retry_budget_s`` how long a request without a ``DEADLINE_MS`` is retried
    while no backend can take it (0: failed at once). ``load_factor`` and ``vnodes`` set ``chwbl``, ``weights``
    ``weighted`` (``policies.WeightedScorers``); ``mem_templates`` / ``disk_templates`` are the backends' store
    capacities in entries, which the router's shadow of each store uses; ``lora_load_ms`` the cold load of one LoRA
    adapter a backend was not recently routed; ``max_inflight`` / ``max_inflight_per_backend`` bound the requests in
    flight (more are refused with RESOURCE_EXHAUSTED); ``backend_key`` the key every call to a backend carries
    (``backend_guard``); ``mask_threshold`` the gray level masks are read as edited from (default: the settings'
    ``MASKEDIT_MASK_THRESHOLD``, as the backends read theirs: both must agree for the router to price the region
    they edit)."""
    path = profile or default_profile()
    cost = CostModel.load_file(path) if Path(path).exists() else CostModel.fallback()
    if resolution is None:
        resolution = cost.meta.get("resolution") or _profiled_resolution(cost.meta.get("model_dir")) or 1024
    est = policies.Estimator(cost, lora_load_ms=lora_load_ms)
    MASK_RATIOS.threshold = load_settings().mask_threshold if mask_threshold is None else mask_threshold
    router = Router(addrs, policies.make(policy, est, load_factor=load_factor, vnodes=vnodes, weights=weights), est,
                    resolution=resolution, admission_wait_s=admission_wait_s, retry_budget_s=retry_budget_s,
                    max_inflight=max_inflight, max_inflight_per_backend=max_inflight_per_backend,
                    backend_key=backend_key)
    router.store_capacity = (mem_templates, disk_templates)
    for b in router.backends.values():
        b.load.mem_templates, b.load.disk_templates = mem_templates, disk_templates
    return router


def _profiled_resolution(model_dir: str | None) -> int | None:
    """The working resolution of the model a profile was measured on, if its directory (as recorded, or by
    name beside the configured model directory, e.g. a checkout's models/) is at hand."""
    if not model_dir:
        return None
    for d in (Path(model_dir), load_settings().model_dir.parent / Path(model_dir).name):
        if (d / SERVING_DEFAULTS_FILE).exists():
            return load_settings({"MASKEDIT_MODEL_DIR": str(d)}).resolution
    return None


def serve(router: Router, port: int, http_port: int | None, host: str = "127.0.0.1",
          limits: StreamLimits | None = None, keyring: Keyring | None = None, tls: TlsFiles | None = None):
    """The router's gRPC port (``grpc.aio``, bounded by ``limits``) and its HTTP port (``/metrics``, ``/health`` and
    Triton's HTTP/REST protocol under ``/v2``, ``kserve_http``). ``keyring``: API keys checked on both (None: open);
    ``tls``: both serve TLS only (the HTTP ports then reach the gRPC logic through a plaintext loopback port, where
    keys are checked all the same). Returns ``(server, bound port, httpd)``; ``server.stop(grace).wait(timeout)``
    stops it; ``server.loopback_port or bound`` is the port the router's own HTTP frontends call."""
    limits = limits or StreamLimits()
    keyring = keyring or Keyring()
    service = RouterService(router, limits, keyring)
    server = AioServer("router-aio")
    server.on_stop.append(service.close)
    bound = server.start(lambda s: service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, s),
                         f"{host}:{port}", CHANNEL_OPTIONS + limits.grpc_options(),
                         credentials=tls.grpc_credentials() if tls else None, loopback=tls is not None)
    inner = server.loopback_port or bound

    def health():
        now = time.monotonic()
        bs = [{"addr": b.addr, "healthy": b.load.healthy, "inflight": b.load.inflight,
               "backlog_ms": round(b.load.backlog_ms, 1), "circuit_open": b.circuit_open,
               "in_rotation": b.available(), "admission": b.admission.view(now)}
              for b in list(router.backends.values())]
        return {"ready": any(b["in_rotation"] for b in bs), "policy": router.policy.name,
                "backends": bs}

    kserve = KServeHttp(f"127.0.0.1:{inner}", metrics=router.metrics)  # through the router's own gRPC port
    server.on_stop.append(kserve.close)
    httpd = serve_http(http_port, router.metrics, health, host, kserve, keyring,
                       tls.ssl_context() if tls else None) if http_port is not None else None
    return server, bound, httpd


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--backends", help="comma-separated host:port of Triton gRPC endpoints")
    src.add_argument("--backends-file", type=Path)
    src.add_argument("--backends-dns", help="host:port; every address the name resolves to (a headless Service), "
                     "re-resolved every 5 s")
    ap.add_argument("--port", type=int, default=7001)
    ap.add_argument("--http-port", type=int, default=7002)
    ap.add_argument("--openai-port", type=int, default=7003, help="OpenAI-compatible HTTP API (0: off)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a container)")
    ap.add_argument("--ext-proc-port", type=int, default=0, help="serve Envoy ext_proc as a Gateway API Inference "
                    "Extension endpoint picker on this port (0: off)")
    ap.add_argument("--target-port", type=int, help="the port the picker names on the chosen pod for gRPC requests "
                    "(the InferencePool's target port; default: the backend's own gRPC port)")
    ap.add_argument("--http-target-port", type=int, help="the same for HTTP requests (Triton's HTTP port)")
    ap.add_argument("--policy", default="predicted", choices=list(policies.POLICIES),
                    help="predicted (default): lowest predicted latency with cache affinity; chwbl: consistent hashing "
                    "with bounded loads on the template key; p2c: power of two choices on masked tokens x steps; "
                    "weighted: llm-d-style weighted scorers; round_robin, least_requests, least_masked_tokens")
    ap.add_argument("--chwbl-load-factor", type=float, default=1.25, help="chwbl: a backend takes a request while "
                    "its requests in flight stay within load factor x the mean (>= 1)")
    ap.add_argument("--chwbl-vnodes", type=int, default=100, help="chwbl: points per backend on the hash ring")
    ap.add_argument("--weights", default="", help="weighted: scorer weights, e.g. affinity=3,queue=2,utilisation=2 "
                    "(the defaults; normalised to sum to 1)")
    ap.add_argument("--store-mem-templates", type=int, default=16, help="template entries a backend's memory tier "
                    "holds (its MASKEDIT_CACHE_MEM_BYTES / an entry's size): the router's shadow of each store")
    ap.add_argument("--store-disk-templates", type=int, default=64, help="and its disk tier")
    ap.add_argument("--lora-load-ms", type=float, default=policies.LORA_LOAD_MS, help="predicted cold load of one "
                    "LoRA adapter on a backend the router has not recently sent it to (docs/lora.md: measured by "
                    "`python -m maskedit_lab.addons.lora_load`)")
    ap.add_argument("--profile", type=Path, help="cost-model profile (default: MASKEDIT_COST_PROFILE, else the served "
                    "model's profile in MASKEDIT_PROFILES_DIR, else the benchmark model's CPU profile)")
    ap.add_argument("--resolution", type=int, help="the served model's working resolution (default: the profiled "
                    "model's, else 1024)")
    ap.add_argument("--admission-wait-s", type=float, default=0.6, help="the longest an edit may wait in front of a "
                    "backend's admission check: sent only where it is predicted to get there sooner, refused "
                    "(RESOURCE_EXHAUSTED) at once when no backend is, and refused and cancelled on the backend once "
                    "it has waited this long (0: off, each backend decides alone)")
    ap.add_argument("--retry-budget-s", type=float, default=30.0, help="a request that finds no backend up (none "
                    "healthy, or all failed it before it streamed anything) is retried with backoff for its "
                    "DEADLINE_MS, else for this long (0: failed at once)")
    ap.add_argument("--max-inflight", type=int, default=256, help="requests in flight through the router at once; "
                    "more are refused at once (RESOURCE_EXHAUSTED)")
    ap.add_argument("--max-inflight-per-backend", type=int, default=32, help="and on any one backend")
    ap.add_argument("--max-streams", type=int, default=StreamLimits.max_streams, help="client streams open at once "
                    "on the gRPC port; more are refused at once (RESOURCE_EXHAUSTED)")
    ap.add_argument("--max-streams-per-connection", type=int, default=StreamLimits.max_streams_per_connection,
                    help="client streams open at once on one client connection; more are refused at once")
    ap.add_argument("--stream-idle-timeout-s", type=float, default=StreamLimits.idle_timeout_s, help="a stream with "
                    "nothing in flight that sent nothing for this long is ended (UNAVAILABLE; 0: never)")
    ap.add_argument("--backend-stream-idle-s", type=float, default=30.0, help="the router's stream to a backend "
                    "(one, shared by every client stream) is closed after this long with nothing on it (0: as soon "
                    "as nothing is, i.e. a stream per request when requests do not overlap)")
    ap.add_argument("--picker-max-streams", type=int, default=PICKER_LIMITS.max_streams, help="ext_proc streams "
                    "open at once on the endpoint picker (one connection may hold them all: Envoy multiplexes)")
    ap.add_argument("--picker-idle-timeout-s", type=float, default=PICKER_LIMITS.idle_timeout_s, help="an ext_proc "
                    "stream that sent nothing for this long is ended (longer than the longest edit; 0: never)")
    ap.add_argument("--openai-max-requests", type=int, default=HttpLimits.max_requests, help="edits the OpenAI "
                    "port serves at once; more are answered 429 at once")
    ap.add_argument("--openai-body-timeout-s", type=float, default=HttpLimits.body_timeout_s, help="a request "
                    "body must arrive within this (else 408)")
    ap.add_argument("--openai-keepalive-timeout-s", type=float, default=HttpLimits.keepalive_timeout_s, help="an "
                    "idle connection, or one that has not sent a whole request head, is closed after this")
    sec = load_settings().security
    ap.add_argument("--api-keys-file", type=Path, default=sec.api_keys_file, help="API keys, one a line: key, "
                    "tenant, role (user|admin), optional rps=, burst=, concurrent=, weight= (docs/security.md); "
                    "re-read on change; checked on every port but health and metrics (default: "
                    "MASKEDIT_API_KEYS_FILE; none: every caller is let in)")
    ap.add_argument("--tls-cert", type=Path, default=sec.tls_cert, help="PEM certificate of the gRPC, HTTP and "
                    "OpenAI ports (default: MASKEDIT_TLS_CERT); with --tls-key they serve TLS only")
    ap.add_argument("--tls-key", type=Path, default=sec.tls_key, help="its PEM private key (MASKEDIT_TLS_KEY)")
    ap.add_argument("--backend-key-file", type=Path, default=sec.backend_key_file, help="the backends' shared "
                    "secret (default: MASKEDIT_BACKEND_KEY_FILE): sent on every call to a backend and set by the "
                    "endpoint picker on what the gateway sends on, for Tritons started with it (they refuse calls "
                    "without it)")
    ap.add_argument("--fair-share-slots", type=int, default=0, help="edits the router lets into each backend at "
                    "once (its batch, about); more wait in the router's fair queue and go in weighted fair order "
                    "of their tenants (key-file weights) (0: off, no queue in the router)")
    ap.add_argument("--fair-queue-wait-s", type=float, default=5.0, help="the longest an edit waits in that queue "
                    "before it is refused (RESOURCE_EXHAUSTED)")
    ap.add_argument("--fifo-queue", action="store_true", help="serve that queue first-come first-served instead "
                    "of by fair share (for comparison)")
    ap.add_argument("--admission-poll-s", type=float, default=0.05, help="how often a backend's pre-processing "
                    "statistics are read for admission while router edits wait in front of its admission check or it "
                    "is refusing")
    ap.add_argument("--admission-idle-poll-s", type=float, default=1.0, help="and how often otherwise: the counts "
                    "are read only while a backend refuses, and an idle backend's only set the base of its next busy "
                    "spell (below --admission-poll-s: --admission-poll-s)")
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="after start, move every object the start made out of the garbage collector's reach "
                         "(gc.freeze), so no collection walks them mid-request")
    return ap


@dataclass
class RunningRouter:
    """A router started by ``start``: its parts, and ``stop()``."""

    args: argparse.Namespace
    router: Router
    keyring: Keyring
    port: int  # the bound gRPC port
    server: object
    httpd: object
    checker: HealthChecker
    watcher: AdmissionWatcher | None
    openai: OpenAIServer | None
    ext_proc: tuple | None

    @property
    def url(self) -> str:
        return f"{self.args.host}:{self.port}"

    def describe(self) -> dict:
        a = self.args
        return {"router": self.url, "http": a.http_port, "policy": a.policy, "admission_wait_s": a.admission_wait_s,
                "api_keys": self.keyring.enabled, "tls": bool(a.tls_cert), "backend_key": bool(a.backend_key_file),
                "fair_share_slots": a.fair_share_slots, "openai": self.openai.port if self.openai else None,
                "ext_proc": self.ext_proc[1] if self.ext_proc else None, "backends": list(self.router.backends)}

    def stop(self) -> None:
        self.keyring.stop()
        self.checker.stop()
        if self.router.fair is not None:
            self.router.fair.stop()
        if self.watcher:
            self.watcher.stop()
        if self.ext_proc:
            self.ext_proc[0].stop(grace=5).wait(10)
        if self.openai:
            self.openai.stop()
        self.server.stop(grace=5).wait(10)
        self.router.backend_streams.close()
        if self.httpd:
            self.httpd.shutdown()


def _log_to_stderr() -> None:
    """The router's JSON log lines on stderr, once per process, unless the process set up its logging already (a
    test runner, an embedding program): then its handlers get them."""
    root = logging.getLogger("maskedit")
    configured = logging.getLogger().handlers or root.handlers
    if not configured:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter("router"))
        root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)


def start(args: argparse.Namespace, health: dict | None = None) -> RunningRouter:
    """Start the router as ``args`` (``parser()``'s) say: the one place a router is started, by
    ``python -m maskedit_router`` and by every launcher (``make serve INSTANCES=N``, the lab cluster, the load and
    chaos tools), so the settings' API keys, TLS and backend key apply everywhere. ``health``: the health checker's
    intervals (tests). A bad setting raises ValueError naming it (never a key)."""
    limits = StreamLimits(args.max_streams, args.max_streams_per_connection, args.stream_idle_timeout_s)
    picker_limits = StreamLimits(args.picker_max_streams, args.picker_max_streams, args.picker_idle_timeout_s)
    http_limits = HttpLimits(args.openai_max_requests, args.openai_body_timeout_s, args.openai_keepalive_timeout_s)
    weights = policies.parse_weights(args.weights)
    policies.WeightedScorers(weights)  # checked at start
    for flag in ("admission_poll_s", "admission_idle_poll_s"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    if args.chwbl_load_factor < 1:
        raise ValueError(f"--chwbl-load-factor: must be >= 1, got {args.chwbl_load_factor}")
    tls = TlsFiles.of(args.tls_cert, args.tls_key)
    keyring = Keyring(args.api_keys_file)  # a bad file stops the start here, naming its line
    backend_key = backend_guard.read(args.backend_key_file) if args.backend_key_file else None
    _log_to_stderr()
    log = logging.getLogger("maskedit.router")

    router = build(read_backends(args), args.policy, args.profile, args.resolution, args.admission_wait_s,
                   args.retry_budget_s, args.chwbl_load_factor, args.chwbl_vnodes, weights, args.store_mem_templates,
                   args.store_disk_templates, args.lora_load_ms, args.max_inflight, args.max_inflight_per_backend,
                   backend_key)
    keyring.metrics = router.metrics
    router.backend_streams.idle_s = max(0.0, args.backend_stream_idle_s)
    if args.fair_share_slots > 0:
        router.fair = FairQueue(lambda: args.fair_share_slots * max(1, len(router.available())),
                                args.fair_queue_wait_s, fair=not args.fifo_queue, on_wait=router.metrics.queue_wait,
                                why_busy=lambda: "" if router.available() else NO_BACKEND_HOLDS_SLOTS)
    server, port, httpd = serve(router, args.port, args.http_port, args.host, limits, keyring, tls)
    keyring.start()
    log.info(keyring.describe())  # never the keys; without a key file: the one line saying it is open
    log.info("TLS on the gRPC, HTTP and OpenAI ports from %s" % args.tls_cert if tls else
             "no TLS: the ports serve plaintext (put a TLS-terminating proxy in front, or set --tls-cert/--tls-key)")
    if backend_key:
        log.info("backend key on: every call to a backend carries it (backends started with it refuse callers "
                 "without it)")
    elif keyring.enabled:
        log.warning("API keys on, but no backend key: a caller that reaches a backend's ports directly is served "
                    "without a key (set MASKEDIT_BACKEND_KEY_FILE for the router and the backends; docs/security.md)")
    checker = HealthChecker(router, **(health or {})).start()
    watcher = AdmissionWatcher(router, args.admission_poll_s, idle_interval_s=args.admission_idle_poll_s).start() \
        if args.admission_wait_s > 0 else None
    openai = OpenAIServer(f"127.0.0.1:{server.loopback_port or port}", args.openai_port, args.host,
                          limits=http_limits, metrics=router.metrics, keyring=keyring,
                          ssl_context=tls.ssl_context(lambda e: handshake_failed(router.metrics, "openai", e))
                          if tls else None).start() if args.openai_port else None
    picker = EndpointPicker(router, args.target_port, args.http_target_port, keyring)
    ext_proc = serve_picker(picker, args.ext_proc_port, args.host, picker_limits) if args.ext_proc_port else None
    return RunningRouter(args, router, keyring, port, server, httpd, checker, watcher, openai, ext_proc)


def read_backends(args) -> list[str]:
    if args.backends:
        return discovery.from_list(args.backends)
    if args.backends_dns:
        return discovery.from_dns(args.backends_dns)
    return discovery.from_file(args.backends_file)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    try:
        running = start(args)
    except ValueError as e:
        parser().error(str(e))
    if args.gc_freeze:
        # What start built (backends, channels, the policy's tables, gRPC's machinery) lives as long as the process:
        # frozen out of the collector, a full collection no longer walks it, holding the GIL, under a request.
        gc.collect()
        gc.freeze()
    print(json.dumps({**running.describe(), "gc_frozen_objects": gc.get_freeze_count()}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(5.0):
        if args.backends_file or args.backends_dns:
            running.router.set_backends(read_backends(args))
    running.stop()


if __name__ == "__main__":
    main()
