"""`make router-scale` (`python -m maskedit_lab.routing.scale`): the real router process in front of 32 and 128
emulated Triton instances (``triton_emulator``: the real protocol, step times from the calibrated cost model).

1. **Overhead** (per cluster size, the router's defaults, ``--policy``): open-loop Poisson load at a ladder of rates,
   short emulated service times. Each rate's schedule is sent twice in the same run, with the same requests at the
   same offsets: straight to the instances (round-robin over their addresses, the router running idle beside them,
   its polls answered as in production) and through the router, segment by segment in ABBA order
   (``direct_baseline``). Per rate: the added latency of each path (end to end at the client less the instance's
   own receipt-to-answer time; ``added_ms_*`` is the routed path's, as before), the **router hop** (routed P50/P99
   less direct P50/P99: a difference of percentiles), the routing decision P50/P99 (the router's
   ``maskedit_router_decision_seconds`` histogram, interpolated within its buckets), reading the request's features
   before it (P50/P99 of ``maskedit_router_features_seconds``), the admission statistics calls per second idle and
   under load, the router's CPU per request
   (gross; and net of its idle rate, which overshoots), the emulator's and the load generator's CPU per path, the
   request size and the host's load average before and after. The ladder stops after the first rate whose hop P99
   passes ``--added-p99-ms`` (5 ms); the summary names the highest rate within it. The load generator's lateness
   (send time past schedule) is recorded on both paths: a rate where it lags is not the router's figure.
   Each emulated result carries an IMAGE of ``--answer-bytes`` (default: the template's size, as a real
   instance's edited PNG; the router relays it). ``--masks`` (both parts): ``sent-once`` (default), every
   request's mask bytes its own, so the router decodes every mask; ``pooled``, 48 masks sent again, as a
   template's edits resend its mask (the router's mask memory, ``features.MaskRatios``, answers those without a
   decode).
2. **Policies through the real router** (``--compare-workers``, 32): the simulator's workload (a window of the
   GenTD26 trace: arrivals, steps, LoRA adapters; production mask ratios; templates per checkpoint, which the
   served ensemble does not see as checkpoints) at loads 0.8 and 0.95 for predicted, chwbl, p2c and weighted,
   through the real router with time compressed by ``--time-scale`` (instances and the router's profile alike);
   the simulator replays the very same requests (arrivals, template keys, the masks' measured ratios, adapters,
   deadlines, the router's backend names) and both P95s and means are reported side by side. The router runs with
   admission off and in-flight bounds lifted, as the simulator has neither (its defaults would refuse requests past
   256 in flight).

Every row says ``"emulated_instances": true``; the meta names the device (``cpu``: no accelerator anywhere), the
commit and what every column means. Writes ``perf_profiles/results/router_scale.json`` and ``.png`` (``--out``
elsewhere for diagnostic runs: the default overwrites the committed result).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from maskedit.launcher import free_ports
from maskedit_router.__main__ import default_profile
from maskedit_router.placement.estimator import LORA_LOAD_MS

from .. import REPO_ROOT
from .direct_baseline import (DIRECT, HOP_DEFINITION, ROUTED, abba, added_ms, latency_fields, pct, rounded,
                              segment_count, split, summary, within_target, within_target_added)
from .sim import TraceWorkload, ideal_service_s
from .triton_emulator import EmulatorConfig, scaled_profile

RESULTS = REPO_ROOT / "perf_profiles" / "results"
COMPARED = ("predicted", "chwbl", "p2c", "weighted")
POLLS = "maskedit_router_admission_polls"  # the router's admission statistics calls (a counter)
EMULATED = EmulatorConfig(Path())  # the emulated instances' serving settings (the emulator's defaults)


# -- the processes ------------------------------------------------------------------------------------------
def _on_cpus(argv: list[str], cpus) -> list[str]:
    """``argv`` run on ``cpus`` only, every thread it starts included (``taskset``: no Python runs between fork and
    exec, which a ``preexec_fn`` in this threaded process would); ``argv`` itself for anywhere."""
    return ["taskset", "-c", ",".join(map(str, sorted(cpus))), *argv] if cpus else list(argv)


def pin_this_process(cpus) -> None:
    """Every thread of this process (the load generator) on ``cpus``: affinity is per thread on Linux, and threads
    started later inherit their starter's."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), set(cpus))


@contextlib.contextmanager
def running_emulator(instances: int, profile: Path, time_scale: float, out: Path, lora_load_ms: float = LORA_LOAD_MS,
                     stats: Path | None = None, cpus=None, image_bytes: int = 0):
    """The emulated instances (one process); yields (process, their addresses); stopped by pid on the way out
    (``stats``: each instance's counts are written there as it stops; ``cpus``: the cores it may use;
    ``image_bytes``: each result's IMAGE size, 0 for a few bytes)."""
    log = open(out / f"emulator-{instances}.log", "ab")
    proc = subprocess.Popen(_on_cpus([sys.executable, "-m", "maskedit_lab.routing.triton_emulator",
                                      "--instances", str(instances),
                                      "--profile", str(profile), "--time-scale", str(time_scale),
                                      "--lora-load-ms", str(lora_load_ms),
                                      "--image-bytes", str(image_bytes),
                                      *(["--stats", str(stats)] if stats else [])], cpus),
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"emulator did not start; see {out / f'emulator-{instances}.log'}")
        yield proc, json.loads(line)["emulated_instances"]
    finally:
        _stop(proc)
        log.close()


@contextlib.contextmanager
def running_router(addrs: list[str], profile: Path, out: Path, policy: str, extra: list[str],
                   env: dict[str, str] | None = None, cpus=None):
    """The real router process (``python -m maskedit_router``) in front of ``addrs``; yields (process, grpc address,
    http port) once its health says ready (``env``: its environment, default this one's; ``cpus``: the cores it may
    use, as a router given its own cores in a deployment)."""
    grpc_port, http_port = free_ports(2)
    log = open(out / "router.log", "ab")
    proc = subprocess.Popen(_on_cpus([sys.executable, "-m", "maskedit_router", "--backends", ",".join(addrs),
                                      "--port", str(grpc_port), "--http-port", str(http_port), "--openai-port", "0",
                                      "--policy", policy, "--profile", str(profile), *extra], cpus),
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}; see {out / 'router.log'}")
            h = _get_json(f"http://127.0.0.1:{http_port}/health")
            if h and h.get("ready") and all(b["in_rotation"] for b in h["backends"]):
                break
            time.sleep(0.3)
        else:
            raise TimeoutError("router not ready")
        yield proc, f"127.0.0.1:{grpc_port}", http_port
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process so far (all its threads)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def switch_interval_env(ms: float, out: Path) -> dict[str, str]:
    """The environment for a router process whose GIL switch interval is ``ms`` (Python's default: 5 ms): a
    ``sitecustomize`` on its PYTHONPATH only, so the emulator and the load generator keep theirs. A diagnostic for
    whether the router's thread hand-offs wait on the GIL."""
    site = out / "router-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.setswitchinterval({ms / 1000.0!r})\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def commit() -> dict:
    """The checkout the run measured: its commit, and whether tracked files differed from it."""
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *a], capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "HEAD") or None
    return {"commit": sha, "commit_dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if sha else None}


def scrape(http_port: int) -> list:
    """The router's Prometheus metrics (parsed families)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
        return list(text_string_to_metric_families(r.read().decode()))


def buckets(families: list, name: str, **labels) -> dict[float, float]:
    """Histogram ``name``'s cumulative counts by upper bound (seconds), of the series with ``labels``."""
    return {float(s.labels["le"]): s.value for fam in families if fam.name == name for s in fam.samples
            if s.name.endswith("_bucket") and all(s.labels.get(k) == v for k, v in labels.items())}


def counted(families: list, name: str) -> float:
    """Counter ``name`` (its ``_total``), summed over its labels."""
    return sum(s.value for fam in families if fam.name == name for s in fam.samples if s.name.endswith("_total"))


def router_fit(families: list) -> dict:
    """The router's online fit of the cost model (``predicted``), from its scraped metrics: its scale (1: the
    profile holds) and whether it has fallen back to least masked tokens (stale)."""
    return {fam.name.removeprefix("maskedit_router_model_"): round(fam.samples[0].value, 3)
            for fam in families if fam.name in ("maskedit_router_model_scale", "maskedit_router_model_stale")}


def histogram_quantile(before: dict, after: dict, q: float) -> float | None:
    """Quantile ``q`` of the observations between two cumulative histograms, linear within a bucket (as
    Prometheus's ``histogram_quantile``)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank, lo, prev = q * total, 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if b == float("inf"):
                return lo
            return lo + (b - lo) * ((rank - prev) / max(1e-12, c - prev))
        lo, prev = b, c
    return lo


def quantiles(before: list, after: list, name: str, **labels) -> tuple:
    """P50 and P99 (seconds) of histogram ``name``'s observations between two scrapes."""
    h0, h1 = buckets(before, name, **labels), buckets(after, name, **labels)
    return tuple(histogram_quantile(h0, h1, q) for q in (0.5, 0.99))


def _ms(seconds: float | None, nd: int = 4) -> float | None:
    return rounded(None if seconds is None else seconds * 1000, nd)


# -- the requests -------------------------------------------------------------------------------------------
class Payloads:
    """Encoded inputs at the model's resolution, made once: one template image whose bytes carry each template's key
    after its end (a PNG reader stops at IEND; the router hashes every byte, so each key is its own template at a
    real template's size) and a pool of masks at ratios over the workload's range (each request takes the nearest:
    its ratio as the router measures it is what the simulator replays). ``masks_sent_once``: every request's mask
    bytes are its own (a count after the mask's end), so the router decodes each one, as for masks made per photo;
    otherwise the pool's masks are sent again, as a template's edits resend its mask (the router remembers those)."""

    def __init__(self, resolution: int, n_masks: int = 48, seed: int = 5, masks_sent_once: bool = False):
        from maskedit import samples
        from maskedit_client import encode_image
        from maskedit_router.placement.features import mask_ratio

        self.resolution = resolution
        self.base = encode_image(samples.template(resolution, resolution, seed=seed))
        rng = np.random.default_rng(seed)
        targets = np.concatenate([np.geomspace(0.01, 0.95, n_masks // 2), rng.uniform(0.01, 0.6, n_masks // 2)])
        self.masks = [encode_image(samples.mask(resolution, resolution, float(r), "blob", seed=i))
                      for i, r in enumerate(targets)]
        self.ratios = np.array([mask_ratio(m, resolution)[0] for m in self.masks])
        self.masks_sent_once = masks_sent_once
        self._sent = itertools.count()

    def mask(self, i: int) -> bytes:
        """Mask ``i`` of the pool, as the next request sends it."""
        return self.masks[i] + (f"#{next(self._sent)}".encode() if self.masks_sent_once else b"")

    def template(self, key: str) -> bytes:
        return self.base + key.encode()

    def mask_for(self, ratio: float) -> int:
        return int(np.argmin(np.abs(self.ratios - ratio)))


def edit_request(payloads: Payloads, key: str, mask: int, steps: int, adapters=(), deadline_ms: int | None = None,
                 progress: bool = False):
    """A ``ModelInferRequest`` for ``edit`` as the project's client builds it (raw BYTES contents)."""
    from tritonclient.grpc._utils import _get_inference_request

    from maskedit_client.inputs import edit_inputs

    loras = [(a, 1.0) for a in adapters] or None
    inputs = edit_inputs(payloads.template(key), payloads.mask(mask), "a photo", seed=1, steps=steps,
                         deadline_ms=deadline_ms, progress=progress, loras=loras)
    req = _get_inference_request("edit", inputs, "", "", None, 0, False, False, 0, None, None)
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


@dataclass
class Sent:
    at: float  # scheduled, seconds from the start
    request: object
    sent: float | None = None
    done: float | None = None
    service_s: float | None = None  # the instance's own receipt-to-answer time
    instance: str | None = None
    cache_hit: bool | None = None
    error: str | None = None


class Streams:
    """Client streams to one or more gRPC targets (the router, or every emulated instance), open across blocks so no
    block pays the connection set-up. Request ``i`` of a block goes to target ``i mod len(urls)`` (round-robin over
    the instances' addresses); each target gets ``streams // len(urls)`` streams (at least one), used in turn."""

    def __init__(self, urls: list[str], streams: int = 8):
        self.urls, self.per = list(urls), max(1, streams // max(1, len(urls)))
        self.by_id: dict[str, Sent] = {}
        self._left = 0
        self._finished: asyncio.Event | None = None
        self._t0 = 0.0

    async def __aenter__(self) -> "Streams":
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        options = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]
        self.channels = [grpc.aio.insecure_channel(u, options=options) for u in self.urls]
        self.calls = [[service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer() for _ in range(self.per)]
                      for ch in self.channels]
        loop = asyncio.get_running_loop()
        self._readers = [loop.create_task(self._read(c)) for row in self.calls for c in row]
        return self

    async def __aexit__(self, *exc) -> None:
        for row in self.calls:
            for c in row:
                with contextlib.suppress(Exception):
                    await c.done_writing()
        for r in self._readers:
            r.cancel()
        for ch in self.channels:
            await ch.close()

    @property
    def streams(self) -> int:
        return len(self.urls) * self.per

    async def _read(self, call) -> None:
        loop = asyncio.get_running_loop()
        async for resp in call:
            r = resp.infer_response
            s = self.by_id.get(r.id)
            if s is None or s.done is not None:
                continue  # not this block's (a straggler of an earlier one), or already ended
            final = r.parameters["triton_final_response"].bool_param if "triton_final_response" in r.parameters \
                else False
            if resp.error_message:
                s.error = resp.error_message[:200]
            elif r.outputs:
                info = _edit_info(r)
                if "progress" in info:
                    continue
                s.service_s, s.instance, s.cache_hit = info.get("service_s"), info.get("instance"), \
                    info.get("cache_hit")
            if final or resp.error_message:
                s.done = loop.time() - self._t0
                self._left -= 1
                if self._left == 0:
                    self._finished.set()

    async def send(self, items: list[Sent], wait_s: float = 120.0, tag: str = "r") -> float:
        """Send every request at its time (open loop, from now); fills each ``Sent``; returns the wall time to the
        last answer (or ``wait_s``). Ids are ``tag`` + index, set as each is written (items may share requests)."""
        loop = asyncio.get_running_loop()
        self._left, self._finished = len(items), asyncio.Event()
        if not items:
            return 0.0
        n = len(self.calls)
        self._t0 = t0 = loop.time()
        for i, s in enumerate(items):
            delay = s.at - (loop.time() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            s.request.id = f"{tag}{i}"
            self.by_id[s.request.id] = s
            s.sent = loop.time() - t0
            await self.calls[i % n][(i // n) % self.per].write(s.request)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._finished.wait(), wait_s)
        wall = loop.time() - t0
        for s in items:
            self.by_id.pop(s.request.id, None)
            if s.done is None and s.error is None:
                s.error = "LOST: no answer"
        return wall


async def drive(url: str, items: list[Sent], streams: int = 8, wait_s: float = 120.0) -> float:
    """Send every request at its time (open loop) over ``streams`` client streams to ``url``; fills each ``Sent``;
    returns the wall time."""
    async with Streams([url], streams) as client:
        return await client.send(items, wait_s)


def _edit_info(r) -> dict:
    for i, o in enumerate(r.outputs):
        if o.name == "EDIT_INFO" and i < len(r.raw_output_contents):
            raw = r.raw_output_contents[i]
            return json.loads(raw[4:])
    return {}


# -- 1. overhead ----------------------------------------------------------------------------------------------
SETTLE_S = 0.25  # between blocks: the last block's stream teardown (router threads, emulator tasks) ends first
CPU_OF = ("router", "emulator", "loadgen")


@dataclass
class Block:
    """One path's share of a rate, over all its segments: the requests as sent, and the wall and CPU seconds (router,
    emulator, this load generator) they took."""

    items: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CPU_OF, 0.0))

    def add(self, items: list[Sent], wall_s: float, cpu0: dict, cpu1: dict) -> None:
        self.items += items
        self.wall_s += wall_s
        for k in CPU_OF:
            self.cpu_s[k] += cpu1[k] - cpu0[k]

    def ok(self) -> list[Sent]:
        return [s for s in self.items if s.error is None and s.service_s is not None]

    def cores(self, who: str) -> float | None:
        return rounded(self.cpu_s[who] / self.wall_s, 3) if self.wall_s > 0 else None

    def ms_per_request(self, who: str, n: int) -> float | None:
        return rounded(1000 * self.cpu_s[who] / n) if n else None

    def late_p99(self) -> float | None:
        return rounded(pct([(s.sent - s.at) * 1000 for s in self.items if s.sent is not None], 99))


def overhead_row(instances: int, policy: str, rate: float, direct: Block, routed: Block, *, idle_cpu_per_s: float,
                 decision_s: tuple, fit: dict, request_bytes: float | None, order: str, loadavg_before: tuple,
                 loadavg_after: tuple, target_ms: float, features_s: tuple = (None, None),
                 polls_per_s: float | None = None, idle_polls_per_s: float | None = None) -> dict:
    """One rung of the ladder: the routed block's figures under their old names, the direct block's beside them
    (``direct_``), the router's hop, and the CPU of every process per request and in cores, per block."""
    ok, d_ok = routed.ok(), direct.ok()
    n = len(routed.items)
    gross = routed.cpu_s["router"]
    row = {"kind": "overhead", "emulated_instances": True, "instances": instances, "policy": policy, "rate": rate,
           "requests": n, "segments": len(order) // 2, "block_order": order,
           "ok": len(ok), "errors": n - len(ok), "error_kinds": _kinds(routed.items),
           "direct_ok": len(d_ok), "direct_errors": len(direct.items) - len(d_ok),
           "direct_error_kinds": _kinds(direct.items),
           "achieved_rps": round(len(ok) / routed.wall_s, 2) if routed.wall_s > 0 else None,
           **latency_fields(added_ms(direct.items), added_ms(routed.items)),
           "decision_ms_p50": _ms(decision_s[0]), "decision_ms_p99": _ms(decision_s[1]),
           "features_ms_p50": _ms(features_s[0]), "features_ms_p99": _ms(features_s[1]),
           "admission_polls_per_s_idle": rounded(idle_polls_per_s, 1),
           "admission_polls_per_s": rounded(polls_per_s, 1),
           "router_cpu_ms_per_request_gross": routed.ms_per_request("router", len(ok)),
           "router_cpu_ms_per_request": rounded(1000 * (gross - idle_cpu_per_s * routed.wall_s) / len(ok))
           if ok else None,
           "router_idle_cpu_per_s": rounded(idle_cpu_per_s, 4),
           "router_cpu_cores": routed.cores("router"), "router_cpu_cores_direct": direct.cores("router"),
           "emulator_cpu_cores": routed.cores("emulator"), "emulator_cpu_cores_direct": direct.cores("emulator"),
           "loadgen_cpu_ms_per_request": routed.ms_per_request("loadgen", n),
           "loadgen_cpu_ms_per_request_direct": direct.ms_per_request("loadgen", len(direct.items)),
           "loadgen_cpu_cores": routed.cores("loadgen"), "loadgen_cpu_cores_direct": direct.cores("loadgen"),
           "request_bytes": None if request_bytes is None else int(request_bytes),
           "send_late_ms_p99": routed.late_p99(), "direct_send_late_ms_p99": direct.late_p99(),
           "router_fit_at_end": fit,
           "loadavg_before": [round(x, 2) for x in loadavg_before],
           "loadavg_after": [round(x, 2) for x in loadavg_after], "loadavg_1m": round(loadavg_after[0], 2)}
    row["within_target"] = within_target(row, target_ms)
    row["within_target_added"] = within_target_added(row, target_ms)
    row["generator_kept_up"] = all(x is not None and x <= 5.0
                                   for x in (row["send_late_ms_p99"], row["direct_send_late_ms_p99"]))
    return row


def _cpu_now(pids: dict[str, int]) -> dict[str, float]:
    return {"router": cpu_seconds(pids["router"]), "emulator": cpu_seconds(pids["emulator"]),
            "loadgen": cpu_seconds(os.getpid())}  # this load generator: its event loop and grpc's threads


async def _rate_blocks(addrs: list[str], url: str, parts: list, build, streams: int, pids: dict[str, int],
                       warm, metrics) -> tuple[Block, Block, float | None, str, tuple]:
    """One rate: every segment sent straight to the instances and through the router, in ABBA order
    (``direct_baseline``), over streams kept open for the whole rate; returns the two blocks, the mean serialised
    request size, the order as letters (D/R) and ``metrics()`` (the router's metrics, with the time read) after the
    warm-up and at the end."""
    blocks = {DIRECT: Block(), ROUTED: Block()}
    sizes: list[int] = []
    order = ""
    async with Streams(addrs, streams) as direct, Streams([url], streams) as routed:
        clients = {DIRECT: direct, ROUTED: routed}
        for c in clients.values():  # connections and streams up before anything is timed (answers discarded)
            await c.send(warm(c.streams), 60.0, tag="warm")
        h0 = metrics()
        for j, (part, paths) in enumerate(zip(parts, abba(len(parts)))):
            sched = build(part)
            sizes += [r.ByteSize() for _, r in sched]
            sent = []
            for path in paths:
                items = [Sent(t, r) for t, r in sched]  # the same request objects and offsets on both paths
                c0 = _cpu_now(pids)
                wall = await clients[path].send(items, tag=f"{path[0]}{j}-")
                blocks[path].add(items, wall, c0, _cpu_now(pids))
                sent += items
                order += path[0].upper()
                await asyncio.sleep(SETTLE_S)
            for s in sent:  # built per segment and let go after it: a long, fast rung's payloads never all in memory
                s.request = None
    return blocks[DIRECT], blocks[ROUTED], (float(np.mean(sizes)) if sizes else None), order, (h0, metrics())


def overhead(instances: int, rates: list[float], window_s: float, out: Path, profile: Path, policy: str,
             time_scale: float, added_p99_ms: float, payloads: Payloads, streams: int, steps: int,
             router_args: list[str], segment_s: float = 5.0, router_env: dict | None = None,
             cpus: tuple | None = None, image_bytes: int = 0) -> list[dict]:
    """The rate ladder on one router in front of ``instances`` emulated instances, each rate with its same-run
    direct baseline; stops after the first rate whose router hop P99 passes the target (or where the load generator
    cannot keep its schedule)."""
    from loadgen import workload

    rows = []
    scaled = scaled_profile(profile, time_scale, out / f"profile-x{time_scale:g}.json")
    router_cpus, other_cpus = cpus or (None, None)
    with running_emulator(instances, profile, time_scale, out, LORA_LOAD_MS, cpus=other_cpus,
                          image_bytes=image_bytes) as (emu, addrs), \
            running_router(addrs, scaled, out, policy, ["--lora-load-ms", str(LORA_LOAD_MS * time_scale),
                                                        *router_args], env=router_env,
                           cpus=router_cpus) as (router, url, http_port):
        time.sleep(2.0)
        c0, t0, polls0 = cpu_seconds(router.pid), time.monotonic(), counted(scrape(http_port), POLLS)
        time.sleep(5.0)  # idle: health checks, admission polls
        idle_s = time.monotonic() - t0
        idle_cpu_per_s = (cpu_seconds(router.pid) - c0) / idle_s
        idle_polls_per_s = (counted(scrape(http_port), POLLS) - polls0) / idle_s
        pids = {"router": router.pid, "emulator": emu.pid}
        warm_mask = payloads.mask_for(0.3)

        def warm(k: int) -> list[Sent]:  # a template key the schedule never uses
            return [Sent(0.005 * i, edit_request(payloads, "warm", warm_mask, steps)) for i in range(k)]

        for rate in rates:
            n = max(20, int(rate * window_s))
            reqs = workload.poisson(rate, n, workload="public", n_templates=4 * instances, zipf_s=1.1,
                                    seed=int(rate), steps=steps)
            parts = split([r.t for r in reqs], segment_count(window_s, segment_s))

            def build(part, reqs=reqs):
                return [(t, edit_request(payloads, f"w{reqs[i].template}", payloads.mask_for(reqs[i].mask_ratio),
                                         steps)) for i, t in part]

            load0 = os.getloadavg()
            direct, routed, size, order, ((t0, m0), (t1, m1)) = asyncio.run(_rate_blocks(
                addrs, url, parts, build, streams, pids, warm, lambda: (time.monotonic(), scrape(http_port))))
            row = overhead_row(instances, policy, rate, direct, routed, idle_cpu_per_s=idle_cpu_per_s,
                               decision_s=quantiles(m0, m1, "maskedit_router_decision_seconds", policy=policy),
                               features_s=quantiles(m0, m1, "maskedit_router_features_seconds"),
                               polls_per_s=(counted(m1, POLLS) - counted(m0, POLLS)) / max(1e-9, t1 - t0),
                               idle_polls_per_s=idle_polls_per_s,
                               fit=router_fit(m1), request_bytes=size, order=order, loadavg_before=load0,
                               loadavg_after=os.getloadavg(), target_ms=added_p99_ms)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not row["within_target"] or not row["generator_kept_up"]:
                break
    return rows


def _kinds(items) -> dict:
    out: dict[str, int] = {}
    for s in items:
        if s.error is not None:
            k = s.error.split(":")[0][:40]
            out[k] = out.get(k, 0) + 1
    return out


# -- 2. policies through the real router vs the simulator --------------------------------------------------------
def compare(workers: int, loads: list[float], policies: list[str], n: int, out: Path, profile: Path,
            time_scale: float, payloads: Payloads, streams: int, lora_library: int, slo_scale: float = 2.0,
            trace_start: int = 10000) -> list[dict]:
    from maskedit_common.cost_model import CostModel
    from maskedit_router.placement.features import EditFeatures, extract
    from maskedit_router.placement.policies import Estimator

    from .sim_cluster import replay

    est = Estimator(CostModel.load_file(profile), lora_load_ms=LORA_LOAD_MS)
    wl = TraceWorkload.load(n, trace_start, lora_library=lora_library)
    tokens = (payloads.resolution // 16) ** 2
    masks = [payloads.mask_for(r) for r in wl.ratios]
    # The simulator's features, as the real router will see them: no checkpoint (the served ensemble has one base
    # model), the masks' measured ratios, the router's own template keys
    base = [EditFeatures(wl.templates[i], float(payloads.ratios[masks[i]]), tokens, wl.steps[i],
                         adapters=wl.adapters[i] if wl.adapters else ()) for i in range(n)]
    fs = [replace(f, deadline_s=slo_scale * est.request_ms(f, False) / 1000.0) for f in base]
    reqs = [edit_request(payloads, wl.templates[i], masks[i], wl.steps[i], fs[i].adapters,
                         deadline_ms=max(1, int(fs[i].deadline_s * 1000 * time_scale))) for i in range(n)]
    fs = [replace(f, template_key=extract(r, payloads.resolution).template_key) for f, r in zip(fs, reqs)]
    rows = []
    scaled = scaled_profile(profile, time_scale, out / f"profile-x{time_scale:g}.json")
    router_args = ["--admission-wait-s", "0", "--max-inflight", "1000000", "--max-inflight-per-backend", "1000000",
                   "--lora-load-ms", str(LORA_LOAD_MS * time_scale)]
    for load in loads:
        rate = load * workers / ideal_service_s(fs, est)
        t = wl.arrivals(rate)
        for policy in policies:
            # fresh instances for every run (empty stores, as the simulator's workers start)
            with running_emulator(workers, profile, time_scale, out, LORA_LOAD_MS) as (emu, addrs):
                sim = replay(policy, workers, list(zip(t.tolist(), fs)), est, names=addrs, policy_kw={"seed": 0},
                             cache_templates=EMULATED.mem_templates, disk_templates=EMULATED.disk_templates,
                             max_batch=EMULATED.max_batch, step_fixed_ms=EMULATED.step_fixed_ms)
                slat = np.array([q.done - q.arrival for q in sim["requests"]])
                with running_router(addrs, scaled, out, policy, router_args) as (router, url, http_port):
                    items = [Sent(float(t[i]) * time_scale, reqs[i]) for i in range(n)]
                    c0, e0 = cpu_seconds(router.pid), cpu_seconds(emu.pid)
                    wall = asyncio.run(drive(url, items, streams, wait_s=600 * time_scale + 60))
                    cpu, emu_cpu = cpu_seconds(router.pid) - c0, cpu_seconds(emu.pid) - e0
                    fit = router_fit(scrape(http_port))
            ok = [s for s in items if s.error is None]
            lat = np.array([(s.done - s.sent) / time_scale for s in ok])
            # what the router and the wire added in this run (wall ms; x 1/time_scale in the trace's time)
            added = [(s.done - s.sent - s.service_s) * 1000 for s in ok if s.service_s is not None]
            late = [(s.sent - s.at) * 1000 for s in items if s.sent is not None]
            row = {"kind": "policy", "emulated_instances": True, "instances": workers, "policy": policy,
                   "load": load, "rate": round(rate, 3), "requests": n, "ok": len(ok), "errors": n - len(ok),
                   "error_kinds": _kinds(items), "time_scale": time_scale,
                   "p95_s": rounded(pct(lat, 95)), "mean_s": rounded(lat.mean() if len(lat) else None),
                   "p50_s": rounded(pct(lat, 50)),
                   "sim_p95_s": rounded(np.percentile(slat, 95)), "sim_mean_s": rounded(slat.mean()),
                   "sim_p50_s": rounded(np.percentile(slat, 50)),
                   "misses": sum(not (s.cache_hit) for s in ok), "sim_misses": sim["misses"],
                   "added_ms_p50": rounded(pct(added, 50)), "added_ms_p99": rounded(pct(added, 99)),
                   "send_late_ms_p99": rounded(pct(late, 99)), "router_fit_at_end": fit,
                   "router_cpu_cores": rounded(cpu / wall, 3), "emulator_cpu_cores": rounded(emu_cpu / wall, 3),
                   "wall_s": round(wall, 1), "loadavg_1m": round(os.getloadavg()[0], 2)}
            if row["p95_s"]:
                row["p95_sim_over_real"] = rounded(row["sim_p95_s"] / row["p95_s"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    for load in loads:  # predicted against the best of the others, through the router and in the simulator
        at = {r["policy"]: r for r in rows if r["load"] == load}
        others = [p for p in at if p != "predicted"]
        if "predicted" in at and others and all(at[p]["p95_s"] for p in at):
            best = min(others, key=lambda p: at[p]["p95_s"])
            best_sim = min(others, key=lambda p: at[p]["sim_p95_s"])
            rows.append({"kind": "policy_summary", "emulated_instances": True, "instances": workers, "load": load,
                         "best_baseline": best, "predicted_vs_best_p95": rounded(at["predicted"]["p95_s"] /
                                                                                at[best]["p95_s"] - 1),
                         "sim_best_baseline": best_sim,
                         "sim_predicted_vs_best_p95": rounded(at["predicted"]["sim_p95_s"] /
                                                             at[best_sim]["sim_p95_s"] - 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(rows: list[dict], path: Path, target_ms: float = 5.0) -> None:
    """Left: P99 per emulated-instance count and rate, direct (the harness alone), routed, and the router's hop
    (routed less direct), against the target the hop is judged by. Right: P95 per policy, real router and
    simulator."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6))
    over = [r for r in rows if r["kind"] == "overhead"]
    for k, n in enumerate(sorted({r["instances"] for r in over})):
        rs = sorted([r for r in over if r["instances"] == n], key=lambda r: r["rate"])
        colour = f"C{k}"
        for key, label, style in (("added_ms_p99", "routed", dict(ls="-", marker="o")),
                                  ("direct_added_ms_p99", "direct", dict(ls=":", marker="s")),
                                  ("router_hop_ms_p99", "router hop", dict(ls="--", marker="^", lw=2.2))):
            pts = [(r["rate"], r[key]) for r in rs if r.get(key) is not None]
            if pts:
                axes[0].plot(*zip(*pts), color=colour, label=f"{n} emulated: {label} P99", **style)
    axes[0].axhline(target_ms, color="red", lw=1.0, label=f"target: hop P99 <= {target_ms:g} ms")
    axes[0].axhline(0.0, color="grey", lw=0.5)
    rates = sorted({r["rate"] for r in over})
    axes[0].set(xlabel="offered rate (req/s)", ylabel="added latency, P99 (ms)", xscale="log")
    axes[0].set_title("real router vs the same requests sent straight to the emulated instances, one run", fontsize=10)
    if rates:
        axes[0].set_xticks(rates, [f"{r:g}" for r in rates])
        axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    pol = [r for r in rows if r["kind"] == "policy"]
    labels = [f"{r['policy']}\n{r['load']}" for r in pol]
    x = np.arange(len(pol))
    axes[1].bar(x - 0.2, [r["p95_s"] or 0 for r in pol], 0.4, label="through the real router")
    axes[1].bar(x + 0.2, [r["sim_p95_s"] for r in pol], 0.4, label="simulator, same requests")
    axes[1].set_xticks(x, labels, fontsize=7)
    w = pol[0]["instances"] if pol else 0
    axes[1].set(ylabel="P95 latency (s, trace time)", yscale="log",
                title=f"P95 per policy, {w} emulated instances (GenTD26 window)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, nargs="*", default=[32, 128],
                    help="emulated-instance counts of the overhead runs")
    ap.add_argument("--rates", type=float, nargs="*", default=[25, 50, 100, 200, 400, 800],
                    help="offered rates of the overhead ladder (req/s), in order; stops past the target")
    ap.add_argument("--window-s", type=float, default=20.0, help="seconds of sending per rate, per path")
    ap.add_argument("--segment-s", type=float, default=5.0, help="about this long each segment of a rate's "
                    "schedule, sent direct and routed in ABBA order (an even count per rate)")
    ap.add_argument("--policy", default="predicted", help="the overhead runs' policy")
    ap.add_argument("--overhead-time-scale", type=float, default=0.02, help="emulated durations in the overhead "
                    "runs (short: the router, not the instances, is what is measured)")
    ap.add_argument("--steps", type=int, default=8, help="steps per request in the overhead runs")
    ap.add_argument("--added-p99-ms", type=float, default=5.0, help="the target for the router hop's P99")
    ap.add_argument("--router-args", default="", help="extra router arguments for the overhead runs (use the = "
                    "form: --router-args='--admission-wait-s 0')")
    ap.add_argument("--router-switch-interval-ms", type=float, default=None,
                    help="the overhead runs' router's GIL switch interval (Python's default 5 ms), a diagnostic")
    ap.add_argument("--router-cpus", type=int, nargs="+", default=None,
                    help="the overhead runs' router on these cores and the emulated instances and this load "
                         "generator on the others (a router given cores of its own); default: all share all")
    ap.add_argument("--compare-workers", type=int, default=32, help="emulated instances of the policy runs (0: none)")
    ap.add_argument("--loads", type=float, nargs="*", default=[0.8, 0.95])
    ap.add_argument("--policies", nargs="*", default=list(COMPARED))
    ap.add_argument("--requests", type=int, default=4000, help="trace requests per policy and load")
    ap.add_argument("--time-scale", type=float, default=0.1, help="the policy runs' time compression")
    ap.add_argument("--lora-library", type=int, default=32, help="adapters the trace's num_lora are drawn from")
    ap.add_argument("--streams", type=int, default=8, help="client streams the load generator multiplexes over")
    ap.add_argument("--answer-bytes", type=int, default=None,
                    help="size of each emulated result's IMAGE in the overhead runs (default: the template's, as a "
                         "real instance's edited PNG is about; 0: a few bytes, as before 2026-11-29)")
    ap.add_argument("--masks", choices=["sent-once", "pooled"], default="sent-once",
                    help="sent-once: every request's mask bytes are its own, so the router decodes each (masks made "
                         "per photo); pooled: 48 masks sent again (a template's edits resending its mask), which "
                         "the router remembers")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "router_scale.json")
    return ap


FIELDS = {  # what the overhead rows' columns mean, written into every result
    "added_ms_p50/p99": "routed block: end to end at the client less the instance's own receipt-to-answer time "
                        "(kept under its earlier name; includes the harness's own share)",
    "direct_added_ms_p50/p99": "the same, for the same requests on the same schedule sent straight to the emulated "
                               "instances (round-robin over their addresses) while the router ran idle",
    "router_hop_ms_p50/p99": HOP_DEFINITION,
    "within_target": "0 <= router_hop_ms_p99 <= added_p99_target_ms, no errors on either path (the issue's "
                     "target; a negative hop P99 is the direct path's tail swamping the measurement: unresolved)",
    "within_target_added": "the earlier rule, for continuity: added_ms_p99 <= added_p99_target_ms",
    "router_cpu_ms_per_request_gross": "the router's CPU over the routed blocks per answered request, idle work "
                                       "included (the honest figure)",
    "router_cpu_ms_per_request": "net: less router_idle_cpu_per_s over the routed blocks' wall time; overshoots, "
                                 "as the router's idle work (health probes, admission polls) shrinks under load",
    "router_cpu_cores_direct": "the router's CPU while the direct blocks ran: its idle cost at the same host load",
    "loadgen_cpu_ms_per_request(_direct)": "this load generator's own CPU per sent request, per block",
    "request_bytes": "mean serialised ModelInferRequest (template PNG + mask PNG + parameters)",
    "send_late_ms_p99 / direct_send_late_ms_p99": "the load generator's lateness past schedule; over 5 ms the rate "
                                                  "is not the router's figure (generator_kept_up false)",
    "loadavg_before/after": "the host's 1/5/15-minute load averages around the rate",
    "decision_ms_p50/p99": "the router's maskedit_router_decision_seconds over the rate (both paths' time; only "
                           "routed requests decide), interpolated within its buckets",
    "features_ms_p50/p99": "the router's maskedit_router_features_seconds: reading a request's routing features "
                           "(mask ratio, template hash) before the decision",
    "admission_polls_per_s(_idle)": "the router's admission statistics calls per second over the rate (both "
                                    "paths) and while idle before the ladder (maskedit_router_admission_polls_total)",
}


def meta(args, argv: list[str], profile: Path, resolution: int, payloads) -> dict:
    """The result's self-description: what was emulated, on what, from which commit, and what each column means."""
    return {"command": "python -m maskedit_lab.routing.scale " + " ".join(argv),
            "emulated_instances": "maskedit_lab.routing.triton_emulator: Triton's gRPC protocol, step times from "
                                  "the calibrated cost model, no accelerator; every row says emulated_instances",
            "device": "cpu", "dtype": "none: the emulated instances run no model", **commit(),
            "profile": profile.name, "resolution": resolution, "added_p99_target_ms": args.added_p99_ms,
            "target_judged_on": "router_hop_ms_p99",
            "direct_baseline": "per rate, the schedule in an even number of segments (--segment-s), each sent "
                               "straight to the instances and through the router in ABBA order; see block_order",
            "fields": FIELDS,
            "template_bytes": len(payloads.base), "mask_bytes_mean": int(np.mean([len(m) for m in payloads.masks])),
            "overhead_time_scale": args.overhead_time_scale, "time_scale": args.time_scale,
            "router": "python -m maskedit_router (its own process), defaults unless router_args",
            "router_args": args.router_args, "router_switch_interval_ms": args.router_switch_interval_ms,
            "masks": args.masks,
            "answer_bytes": len(payloads.base) if args.answer_bytes is None else args.answer_bytes,
            "streams": args.streams, "window_s": args.window_s, "segment_s": args.segment_s,
            "router_cpus": args.router_cpus or "all (shared with the emulator and the load generator)",
            "loadgen_cpu": "psutil",
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                     "loadavg_start": [round(x, 2) for x in os.getloadavg()]}}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    profile = args.profile or default_profile()
    from maskedit_common.cost_model import CostModel

    resolution = int(CostModel.load_file(profile).meta.get("resolution") or 512)
    payloads = Payloads(resolution, masks_sent_once=args.masks == "sent-once")
    started = time.time()
    doc_meta = meta(args, argv, profile, resolution, payloads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="maskedit-router-scale-") as tmp:
        tmp = Path(tmp)
        env = switch_interval_env(args.router_switch_interval_ms, tmp) if args.router_switch_interval_ms else None
        cpus = None
        if args.router_cpus:
            mine = os.sched_getaffinity(0)
            rest = tuple(sorted(mine - set(args.router_cpus)))
            if not set(args.router_cpus) < mine or not rest:
                raise SystemExit(f"--router-cpus must leave some of this process's cores {sorted(mine)} to the "
                                 f"others, got {args.router_cpus}")
            cpus = (tuple(args.router_cpus), rest)
            doc_meta["other_cpus"] = list(rest)
            pin_this_process(rest)
        for n in args.instances:
            rows += overhead(n, args.rates, args.window_s, tmp, profile, args.policy, args.overhead_time_scale,
                             args.added_p99_ms, payloads, args.streams, args.steps, args.router_args.split(),
                             segment_s=args.segment_s, router_env=env, cpus=cpus,
                             image_bytes=doc_meta["answer_bytes"])
        if cpus:  # the policy runs share every core, as before
            pin_this_process(mine)
        if args.compare_workers:
            rows += compare(args.compare_workers, args.loads, args.policies, args.requests, tmp, profile,
                            args.time_scale, payloads, args.streams, args.lora_library)
    doc_meta["summary"] = summary(rows)
    doc_meta["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc_meta["wall_s"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": doc_meta, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"), args.added_p99_ms)
    print(json.dumps(doc_meta["summary"]))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
