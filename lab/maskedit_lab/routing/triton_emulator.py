"""`python -m maskedit_lab.routing.triton_emulator`: emulated Triton instances, many in one process, for driving the
real router at scale (the idea of llm-d's inference simulator: a server that speaks the real protocol and takes its
timing from a model instead of a GPU).

Each emulated instance is a ``grpc.aio`` server on its own port that speaks what the router uses of Triton's KServe
v2 gRPC protocol: ``ModelStreamInfer`` for the decoupled ``edit`` ensemble (progress responses when ``PROGRESS``
is set, the result, the empty final response the router asks for), ``ServerLive`` / ``ServerReady`` /
``ModelReady``, ``ServerMetadata``, ``ModelMetadata`` and ``ModelConfig`` (the repository's own ``edit``
config), ``ModelStatistics`` for ``preprocess`` (the counts the router's admission reads: the router scrapes no
Prometheus text from its backends) and ``ModelInfer`` on ``cancel``. The router's health probe (an empty mask)
is answered at once, as Triton's ensemble answers it without running the model.

Behind the protocol each instance is the router simulator's worker (``sim_cluster``) in real time: step-level
continuous batching (max batch 4) with step times from the calibrated cost-model profile (a cached request computes
its masked tokens, a template run the full model; a packed step pays each block's fixed cost once), the store's
memory and disk tiers (LRU, a disk read at the profile's measured cost), LoRA adapters named in ``LORAS`` (a cold
load each where not resident). No pre/post-processing time: the instances model accelerator hosts, as the
simulator's scale-out runs do. ``--time-scale`` compresses every modelled duration (0.1: ten times faster), so a
run of thousands of requests takes minutes; a router in front must predict with the profile scaled alike
(``scaled_profile``). Every response says ``"emulated": true``.

An instance costs no CPU while it waits: each is one coroutine that sleeps until its next step ends (steps are
scheduled back to back on a virtual clock, so a late wake-up does not stretch the emulated timeline).

    python -m maskedit_lab.routing.triton_emulator --instances 32 --base-port 9100 --time-scale 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import hashlib
import json
import signal
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from maskedit_common.cost_model import CostModel
from maskedit_router.placement.books import BackendLoad
from maskedit_router.placement.estimator import LORA_LOAD_MS, Estimator
from maskedit_router.placement.features import EditFeatures, adapter_names, grid_tokens, mask_ratio
from maskedit_router.proxy.backend import EMPTY_FINAL, FINAL

from .. import REPO_ROOT
from .sim_cluster import Worker, batch_shared_ms

EDIT_CONFIG = REPO_ROOT / "model_repository" / "edit" / "config.pbtxt"
MODELS = ("edit", "intake", "preprocess", "masked_denoise", "vae_decode", "cancel")


@dataclass
class EmulatorConfig:
    """What every emulated instance shares: the profile its steps come from and the serving settings the simulator's
    workers have (max batch, store tiers, adapter slots)."""

    profile: Path
    time_scale: float = 1.0  # every modelled duration times this (the router must predict with a profile scaled alike)
    max_batch: int = 4
    step_fixed_ms: float = 2.0
    mem_templates: int = 16
    disk_templates: int = 64
    adapter_slots: int = 32
    lora_load_ms: float = LORA_LOAD_MS
    # the result's IMAGE: 0 answers a few bytes; a real instance sends the edited PNG (~0.3-0.5 MB at 512²), which
    # the router relays, so a measurement of the router's hop should answer that many
    image_bytes: int = 0

    def estimator(self) -> Estimator:
        return Estimator(CostModel.load_file(self.profile), lora_load_ms=self.lora_load_ms)


def scaled_profile(profile: Path, time_scale: float, out: Path) -> Path:
    """A copy of ``profile`` whose every fit predicts ``time_scale`` times the milliseconds: what a router in front of
    time-compressed emulated instances predicts with, so its books drain as fast as the instances work."""
    doc = json.loads(Path(profile).read_text())
    for fits in [*doc.get("compute", {}).values(), doc.get("load", {})]:
        for fit in fits.values():
            fit["coef"] = [c * time_scale for c in fit["coef"]]
    doc.setdefault("meta", {})["time_scale"] = time_scale
    out.write_text(json.dumps(doc))
    return out


@functools.lru_cache(maxsize=4096)
def _mask_ratio(mask: bytes, resolution: int) -> float:
    """The mask's edited-token fraction on the model's grid (a load generator reuses few masks: decoded once each)."""
    return mask_ratio(mask, resolution)[0]


def _raw_inputs(req) -> dict[str, bytes]:
    """Each input's raw bytes (tritonclient sends ``raw_input_contents``; a BYTES tensor's element is its 4-byte
    length, then its bytes)."""
    out = {}
    for i, t in enumerate(req.inputs):
        if i < len(req.raw_input_contents):
            raw = req.raw_input_contents[i]
            out[t.name] = raw[4:4 + struct.unpack("<I", raw[:4])[0]] if t.datatype == "BYTES" and len(raw) >= 4 else raw
        elif t.contents.bytes_contents:
            out[t.name] = t.contents.bytes_contents[0]
    return out


def _scalar(raw: bytes | None, dtype, default):
    return default if not raw else np.frombuffer(raw, dtype)[0].item()


@dataclass
class _Job:
    rid: str
    features: EditFeatures
    progress: bool
    want_final: bool
    out: asyncio.Queue
    received: float
    steps_left: int = 0
    step_ms: float = 0.0
    cached: bool = False
    join_ms: float = 0.0
    started: float = 0.0
    cancelled: bool = False


@dataclass
class _Stats:
    decided: int = 0  # edits past "preprocess" (at once: no pre-processing is modelled)
    edits: int = 0
    probes: int = 0
    cancels: int = 0
    hits: int = 0
    misses: int = 0
    adapter_loads: int = 0
    disk_reads: int = 0


class EmulatedInstance(service_pb2_grpc.GRPCInferenceServiceServicer):
    """One emulated Triton instance: the protocol (this class) over one simulated worker (``_run``)."""

    def __init__(self, name: str, cfg: EmulatorConfig, est: Estimator, resolution: int):
        self.name, self.cfg, self.est, self.resolution = name, cfg, est, resolution
        # made once: incompressible bytes of the result's size, relayed as they are (nothing decodes them)
        self.image = np.random.default_rng(0).bytes(cfg.image_bytes) if cfg.image_bytes else b"emulated"
        self.tokens = grid_tokens(resolution)
        self.shared_ms = batch_shared_ms(est)
        self.worker = Worker(BackendLoad(name), cache_templates=cfg.mem_templates, disk_templates=cfg.disk_templates,
                             adapter_slots=cfg.adapter_slots)
        self.waiting: deque[_Job] = deque()
        self.running: list[_Job] = []
        self.jobs: dict[str, _Job] = {}
        self.stats = _Stats()
        self._wake = asyncio.Event()
        self._clock = 0.0  # virtual time the current step ends
        self._task: asyncio.Task | None = None
        self.config = model_config_pb2.ModelConfig()
        from google.protobuf import text_format

        text_format.Parse(EDIT_CONFIG.read_text(), self.config)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    # -- the worker: step-level batching on a virtual clock ---------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            busy = bool(self.running)
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            # busy: the next step starts where the last one ended, even if this coroutine woke late (a late wake-up
            # must not stretch the emulated timeline); idle: it starts now
            start = self._clock if busy else max(loop.time(), self._clock)
            self._admit(start)
            if not self.running:
                continue
            shared = self.shared_ms * max(0, sum(j.cached for j in self.running) - 1)
            step_ms = self.cfg.step_fixed_ms + sum(j.step_ms + j.join_ms for j in self.running) - shared
            for j in self.running:
                j.join_ms = 0.0
            self._clock = start + step_ms * self.cfg.time_scale / 1000.0
            await asyncio.sleep(max(0.0, self._clock - loop.time()))
            for j in list(self.running):
                j.steps_left -= 1
                if j.cancelled:
                    self.running.remove(j)
                elif j.steps_left <= 0:
                    self.running.remove(j)
                    self._finish(j, self._clock)
                elif j.progress:
                    done = j.features.steps - j.steps_left
                    j.out.put_nowait(_response(j.rid, {"progress": [done, j.features.steps]}, b"", final=False))

    def _admit(self, now: float) -> None:
        """As the simulator's ``start_step``: waiting requests join the batch; a request on a template the worker
        holds (or whose template run is in progress, unless it starts at this very step) is a hit."""
        w, new = self.worker, set()
        while self.waiting and len(self.running) < self.cfg.max_batch:
            j = self.waiting.popleft()
            if j.cancelled:
                continue
            key = j.features.template_key
            tier = w.tier(key)
            cached = tier is not None and key not in new
            extra = 0.0
            if cached and tier == "disk":
                extra += self.est.tier_load_ms("disk")
                self.stats.disk_reads += 1
            cold = w.load_adapters(j.features.adapters)
            extra += cold * self.est.lora_load_ms
            self.stats.adapter_loads += cold
            if not w.holds(key):
                new.add(key)
            self.stats.hits += cached
            self.stats.misses += not cached
            j.cached, j.join_ms, j.started = cached, extra, now
            j.steps_left = j.features.steps
            j.step_ms = self.est.request_ms(j.features, cached) / j.features.steps
            w.touch(key)
            self.running.append(j)

    def _finish(self, j: _Job, at: float) -> None:
        info = {"emulated": True, "instance": self.name, "cache_hit": j.cached, "queue_s": round(j.started - j.received, 6),
                "denoise_s": round(at - j.started, 6), "service_s": round(at - j.received, 6),
                "steps": j.features.steps, "mask_ratio": round(j.features.mask_ratio, 4)}
        self._reply(j, info)

    def _reply(self, j: _Job, info: dict) -> None:
        self.jobs.pop(j.rid, None)
        j.out.put_nowait(_response(j.rid, info, self.image, final=not j.want_final))
        if j.want_final:
            j.out.put_nowait(_response(j.rid, None, None, final=True))

    # -- the protocol -----------------------------------------------------------------------------------
    def _job(self, req, out: asyncio.Queue) -> _Job | None:
        """The request as a job for the worker; None when answered at once (the health probe, an error)."""
        now = asyncio.get_running_loop().time()
        want_final = EMPTY_FINAL in req.parameters and req.parameters[EMPTY_FINAL].bool_param
        if req.model_name != "edit":
            out.put_nowait(_error(req.id, f"INVALID_ARGUMENT: model '{req.model_name}' is not a decoupled model here"))
            return None
        raw = _raw_inputs(req)
        template, mask = raw.get("TEMPLATE"), raw.get("MASK")
        if not template or mask is None:
            out.put_nowait(_error(req.id, "INVALID_ARGUMENT: TEMPLATE and MASK are required"))
            return None
        steps = int(_scalar(raw.get("STEPS"), np.int32, 8))
        register = bool(_scalar(raw.get("REGISTER"), np.bool_, False))
        try:
            ratio = _mask_ratio(bytes(mask), self.resolution)
        except Exception:
            out.put_nowait(_error(req.id, "INVALID_ARGUMENT: MASK: not an image"))
            return None
        key = hashlib.sha1(bytes(template) + f"STEPS={steps}".encode()).hexdigest()[:20]  # its cache key
        job = _Job(req.id, EditFeatures(key, ratio, self.tokens, steps, adapters=adapter_names(req)),
                   bool(_scalar(raw.get("PROGRESS"), np.bool_, False)), want_final, out, now)
        self.stats.decided += 1
        if ratio == 0.0 and not register:  # nothing to edit: every stage runs, the model does not
            self.stats.probes += 1
            self._reply(job, {"emulated": True, "instance": self.name, "skip_model": True, "service_s": 0.0})
            return None
        self.stats.edits += 1
        return job

    async def ModelStreamInfer(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        mine: set[str] = set()

        async def read():
            try:
                async for req in request_iterator:
                    job = self._job(req, out)
                    if job is not None:
                        self.jobs[job.rid] = job
                        mine.add(job.rid)
                        self.waiting.append(job)
                        self._wake.set()
            finally:
                out.put_nowait(None)  # the client half-closed: end once its requests are answered

        reader = asyncio.get_running_loop().create_task(read())
        closing = False
        try:
            while True:
                resp = await out.get()
                if resp is None:
                    closing = True
                else:
                    yield resp
                if closing and out.empty() and not any(r in self.jobs for r in mine):
                    return  # half-closed and every request answered
        finally:
            reader.cancel()
            for rid in mine:  # the stream went away: its requests are dropped, as Triton cancels them
                if rid in self.jobs:
                    self.jobs.pop(rid).cancelled = True

    async def ModelInfer(self, request, context):
        if request.model_name == "cancel":
            ids = []
            for i, t in enumerate(request.inputs):  # REQUEST_IDS: every element
                if t.name == "REQUEST_IDS":
                    ids = [x.decode() for x in t.contents.bytes_contents] or _bytes_elements(
                        request.raw_input_contents[i] if i < len(request.raw_input_contents) else b"")
            for rid in ids:
                job = self.jobs.pop(rid, None)
                if job is not None:
                    job.cancelled = True
                    self.stats.cancels += 1
            return service_pb2.ModelInferResponse(model_name="cancel", id=request.id)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"ModelInfer: model '{request.model_name}' is decoupled; use ModelStreamInfer")

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name in MODELS)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="triton-emulated", version="2.51.0-emulated",
                                                  extensions=["emulated"])

    async def ModelMetadata(self, request, context):
        if request.name != "edit":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no metadata for model '{request.name}' here")
        c = self.config
        return service_pb2.ModelMetadataResponse(
            name=c.name, versions=["1"], platform=c.platform,
            inputs=[service_pb2.ModelMetadataResponse.TensorMetadata(
                name=i.name, datatype=model_config_pb2.DataType.Name(i.data_type)[5:].replace("STRING", "BYTES"),
                shape=list(i.dims)) for i in c.input],
            outputs=[service_pb2.ModelMetadataResponse.TensorMetadata(
                name=o.name, datatype="BYTES", shape=list(o.dims)) for o in c.output])

    async def ModelConfig(self, request, context):
        if request.name != "edit":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no config for model '{request.name}' here")
        return service_pb2.ModelConfigResponse(config=copy.deepcopy(self.config))

    async def ModelStatistics(self, request, context):
        resp = service_pb2.ModelStatisticsResponse()
        for name in ([request.name] if request.name else ["preprocess", "edit"]):
            if name not in MODELS:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no model '{name}'")
            m = resp.model_stats.add()
            m.name, m.version = name, "1"
            m.inference_count = m.execution_count = self.stats.decided
            m.inference_stats.success.count = self.stats.decided
        return resp

    def snapshot(self) -> dict:
        s = self.stats
        return {"instance": self.name, "edits": s.edits, "probes": s.probes, "hits": s.hits, "misses": s.misses,
                "cancels": s.cancels, "adapter_loads": s.adapter_loads, "disk_reads": s.disk_reads,
                "running": len(self.running), "waiting": len(self.waiting)}


def _bytes_elements(raw: bytes) -> list[str]:
    out, i = [], 0
    while i + 4 <= len(raw):
        n = struct.unpack("<I", raw[i:i + 4])[0]
        out.append(raw[i + 4:i + 4 + n].decode())
        i += 4 + n
    return out


def _response(rid: str, info: dict | None, image: bytes | None, final: bool):
    resp = service_pb2.ModelStreamInferResponse()
    r = resp.infer_response
    r.model_name, r.id = "edit", rid
    r.parameters[FINAL].bool_param = final
    if info is not None:
        for name, value in (("IMAGE", image or b""), ("EDIT_INFO", json.dumps(info).encode())):
            o = r.outputs.add()
            o.name, o.datatype = name, "BYTES"
            o.shape.append(1)
            r.raw_output_contents.append(struct.pack("<I", len(value)) + value)  # Triton's BYTES layout
    return resp


def _error(rid: str, message: str):
    resp = service_pb2.ModelStreamInferResponse(error_message=f"{message} [request id: {rid}]")
    resp.infer_response.id = rid
    return resp


@dataclass
class EmulatedCluster:
    """``instances`` emulated instances on consecutive ports from ``base_port`` (0: any free ports), one event loop."""

    cfg: EmulatorConfig
    instances: int
    base_port: int = 0
    host: str = "127.0.0.1"
    servers: list = field(default_factory=list)
    members: list = field(default_factory=list)
    addrs: list = field(default_factory=list)

    async def start(self) -> "EmulatedCluster":
        est = self.cfg.estimator()
        resolution = int(est.cost.meta.get("resolution") or 1024)
        options = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]
        for i in range(self.instances):
            server = grpc.aio.server(options=options)
            port = server.add_insecure_port(f"{self.host}:{self.base_port + i if self.base_port else 0}")
            member = EmulatedInstance(f"emulated-{i}@{self.host}:{port}", self.cfg, est, resolution)
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(member, server)
            await server.start()
            member.start()
            self.servers.append(server)
            self.members.append(member)
            self.addrs.append(f"{self.host}:{port}")
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop(0.5) for s in self.servers))
        for m in self.members:
            if m._task is not None:
                m._task.cancel()

    def snapshot(self) -> list[dict]:
        return [m.snapshot() for m in self.members]


async def _serve(args) -> None:
    cfg = EmulatorConfig(Path(args.profile), args.time_scale, args.max_batch, mem_templates=args.mem_templates,
                         disk_templates=args.disk_templates, lora_load_ms=args.lora_load_ms,
                         image_bytes=args.image_bytes)
    cluster = await EmulatedCluster(cfg, args.instances, args.base_port, args.host).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"emulated_instances": cluster.addrs, "time_scale": args.time_scale,
                      "profile": str(args.profile), "started": time.time()}), flush=True)
    await stop.wait()
    if args.stats:  # what each instance served, for the run's record
        Path(args.stats).write_text(json.dumps(cluster.snapshot()))
    await cluster.stop()


def main(argv=None) -> None:
    from maskedit_router.__main__ import default_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--base-port", type=int, default=0, help="first port (the others follow); 0: free ports")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--profile", type=Path, default=None, help="cost-model profile (default: the router's)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="every modelled duration times this")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--mem-templates", type=int, default=16)
    ap.add_argument("--disk-templates", type=int, default=64)
    ap.add_argument("--lora-load-ms", type=float, default=LORA_LOAD_MS)
    ap.add_argument("--stats", type=Path, help="write each instance's counts here on exit")
    ap.add_argument("--image-bytes", type=int, default=0, help="size of each result's IMAGE (0: a few bytes; a real "
                    "instance sends the edited PNG, ~0.3-0.5 MB at 512²)")
    args = ap.parse_args(argv)
    args.profile = args.profile or default_profile()
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
