"""`make router-scale` (`python -m maskedit_lab.routing.scale`): the real router process in front of 32 and 128
emulated Triton instances (``triton_emulator``: the real protocol, step times from the calibrated cost model).

1. **Overhead** (per cluster size, the router's defaults, ``--policy``): open-loop Poisson load at a ladder of rates,
   short emulated service times. Per rate: router-added latency P50/P99 (what a client waits beyond the instance's
   own time: end-to-end at the client less the instance's receipt-to-answer time, so two extra hops, the routing
   decision and the relay), the routing decision P50/P99 (the router's ``maskedit_router_decision_seconds``
   histogram, interpolated within its buckets), reading the request's features before it (P50/P99 of
   ``maskedit_router_features_seconds``), the admission statistics calls per second idle and under load, the router
   process's CPU per request (its CPU over the rate's
   window, less what it spends idle, per completed request), and the highest rate whose router-added P99 stays
   within ``--added-p99-ms`` (5 ms). The load generator's lateness (send time past schedule) is recorded: a rate
   where it lags is not the router's figure.
2. **Policies through the real router** (``--compare-workers``, 32): the simulator's workload (a window of the
   GenTD26 trace: arrivals, steps, LoRA adapters; production mask ratios; templates per checkpoint, which the
   served ensemble does not see as checkpoints) at loads 0.8 and 0.95 for predicted, chwbl, p2c and weighted,
   through the real router with time compressed by ``--time-scale`` (instances and the router's profile alike);
   the simulator replays the very same requests (arrivals, template keys, the masks' measured ratios, adapters,
   deadlines, the router's backend names) and both P95s and means are reported side by side. The router runs with
   admission off and in-flight bounds lifted, as the simulator has neither (its defaults would refuse requests past
   256 in flight).

Every row says ``"emulated_instances": true``. Writes ``perf_profiles/results/router_scale.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from maskedit.launcher import free_ports
from maskedit_router.__main__ import default_profile
from maskedit_router.placement.estimator import LORA_LOAD_MS

from .. import REPO_ROOT
from .sim import TraceWorkload, ideal_service_s
from .triton_emulator import EmulatorConfig, scaled_profile

RESULTS = REPO_ROOT / "perf_profiles" / "results"
COMPARED = ("predicted", "chwbl", "p2c", "weighted")
POLLS = "maskedit_router_admission_polls"  # the router's admission statistics calls (a counter)
EMULATED = EmulatorConfig(Path())  # the emulated instances' serving settings (the emulator's defaults)


# -- the processes ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def running_emulator(instances: int, profile: Path, time_scale: float, out: Path, lora_load_ms: float = LORA_LOAD_MS,
                     stats: Path | None = None):
    """The emulated instances (one process); yields (process, their addresses); stopped by pid on the way out
    (``stats``: each instance's counts are written there as it stops)."""
    log = open(out / f"emulator-{instances}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "maskedit_lab.routing.triton_emulator",
                             "--instances", str(instances),
                             "--profile", str(profile), "--time-scale", str(time_scale),
                             "--lora-load-ms", str(lora_load_ms), *(["--stats", str(stats)] if stats else [])],
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
def running_router(addrs: list[str], profile: Path, out: Path, policy: str, extra: list[str]):
    """The real router process (``python -m maskedit_router``) in front of ``addrs``; yields (process, grpc address,
    http port) once its health says ready."""
    grpc_port, http_port = free_ports(2)
    log = open(out / "router.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "maskedit_router", "--backends", ",".join(addrs),
                             "--port", str(grpc_port), "--http-port", str(http_port), "--openai-port", "0",
                             "--policy", policy, "--profile", str(profile), *extra],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
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


def router_fit(http_port: int) -> dict:
    """The router's online fit of the cost model (``predicted``): its scale (1: the profile holds) and whether it
    has fallen back to least masked tokens (stale)."""
    return {fam.name.removeprefix("maskedit_router_model_"): round(fam.samples[0].value, 3)
            for fam in scrape(http_port) if fam.name in ("maskedit_router_model_scale", "maskedit_router_model_stale")}


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


# -- the requests -------------------------------------------------------------------------------------------
class Payloads:
    """Encoded inputs at the model's resolution, made once: one template image whose bytes carry each template's key
    after its end (a PNG reader stops at IEND; the router hashes every byte, so each key is its own template at a
    real template's size) and a pool of masks at ratios over the workload's range (each request takes the nearest:
    its ratio as the router measures it is what the simulator replays)."""

    def __init__(self, resolution: int, n_masks: int = 48, seed: int = 5):
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
    inputs = edit_inputs(payloads.template(key), payloads.masks[mask], "a photo", seed=1, steps=steps,
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


async def drive(url: str, items: list[Sent], streams: int = 8, wait_s: float = 120.0) -> float:
    """Send every request at its time (open loop) over ``streams`` client streams; fills each ``Sent``; returns
    the wall time."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    loop = asyncio.get_running_loop()
    by_id = {}
    for i, s in enumerate(items):
        s.request.id = f"r{i}"
        by_id[s.request.id] = s
    left = len(items)
    finished = asyncio.Event()
    options = [("grpc.max_send_message_length", 512 << 20), ("grpc.max_receive_message_length", 512 << 20)]
    async with grpc.aio.insecure_channel(url, options=options) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelStreamInfer() for _ in range(streams)]

        async def read(call):
            nonlocal left
            async for resp in call:
                s = by_id.get(resp.infer_response.id)
                if s is None or s.done is not None:
                    continue
                r = resp.infer_response
                final = r.parameters["triton_final_response"].bool_param if \
                    "triton_final_response" in r.parameters else False
                if resp.error_message:
                    s.error = resp.error_message[:200]
                elif r.outputs:
                    info = _edit_info(r)
                    if "progress" in info:
                        continue
                    s.service_s, s.instance, s.cache_hit = info.get("service_s"), info.get("instance"), \
                        info.get("cache_hit")
                if final or resp.error_message:
                    s.done = loop.time() - t0
                    left -= 1
                    if left == 0:
                        finished.set()

        readers = [loop.create_task(read(c)) for c in calls]
        t0 = loop.time()
        for i, s in enumerate(items):
            delay = s.at - (loop.time() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            s.sent = loop.time() - t0
            await calls[i % streams].write(s.request)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(finished.wait(), wait_s)
        wall = loop.time() - t0
        for c in calls:
            with contextlib.suppress(Exception):
                await c.done_writing()
        for r in readers:
            r.cancel()
    for s in items:
        if s.done is None and s.error is None:
            s.error = "LOST: no answer"
    return wall


def _edit_info(r) -> dict:
    for i, o in enumerate(r.outputs):
        if o.name == "EDIT_INFO" and i < len(r.raw_output_contents):
            raw = r.raw_output_contents[i]
            return json.loads(raw[4:])
    return {}


def _pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


# -- 1. overhead ----------------------------------------------------------------------------------------------
def overhead(instances: int, rates: list[float], window_s: float, out: Path, profile: Path, policy: str,
             time_scale: float, added_p99_ms: float, payloads: Payloads, streams: int, steps: int,
             router_args: list[str]) -> list[dict]:
    """The rate ladder on one router in front of ``instances`` emulated instances; stops after the first rate past
    the P99 target (or where the load generator cannot keep its schedule)."""
    from loadgen import workload

    rows = []
    scaled = scaled_profile(profile, time_scale, out / f"profile-x{time_scale:g}.json")
    with running_emulator(instances, profile, time_scale, out, LORA_LOAD_MS) as (emu, addrs), \
            running_router(addrs, scaled, out, policy, ["--lora-load-ms", str(LORA_LOAD_MS * time_scale),
                                                        *router_args]) as (router, url, http_port):
        time.sleep(2.0)
        c0, t0, polls0 = cpu_seconds(router.pid), time.monotonic(), counted(scrape(http_port), POLLS)
        time.sleep(5.0)  # idle: health checks, admission polls
        idle_s = time.monotonic() - t0
        idle_cpu_per_s = (cpu_seconds(router.pid) - c0) / idle_s
        idle_polls_per_s = (counted(scrape(http_port), POLLS) - polls0) / idle_s
        for rate in rates:
            n = max(20, int(rate * window_s))
            reqs = workload.poisson(rate, n, workload="public", n_templates=4 * instances, zipf_s=1.1,
                                    seed=int(rate), steps=steps)
            items = [Sent(r.t, edit_request(payloads, f"w{r.template}", payloads.mask_for(r.mask_ratio), steps))
                     for r in reqs]
            m0 = scrape(http_port)
            c0, e0 = cpu_seconds(router.pid), cpu_seconds(emu.pid)
            wall = asyncio.run(drive(url, items, streams))
            cpu = cpu_seconds(router.pid) - c0
            emu_cpu = cpu_seconds(emu.pid) - e0
            m1 = scrape(http_port)
            h0, h1 = (buckets(m, "maskedit_router_decision_seconds", policy=policy) for m in (m0, m1))
            f0, f1 = (buckets(m, "maskedit_router_features_seconds") for m in (m0, m1))
            fit = router_fit(http_port)
            ok = [s for s in items if s.error is None and s.service_s is not None]
            added = [(s.done - s.sent - s.service_s) * 1000 for s in ok]
            late = [(s.sent - s.at) * 1000 for s in items if s.sent is not None]
            dec = [histogram_quantile(h0, h1, q) for q in (0.5, 0.99)]
            feat = [histogram_quantile(f0, f1, q) for q in (0.5, 0.99)]
            row = {"kind": "overhead", "emulated_instances": True, "instances": instances, "policy": policy,
                   "rate": rate, "requests": n, "ok": len(ok), "errors": n - len(ok),
                   "error_kinds": _kinds(items), "achieved_rps": round(len(ok) / wall, 2),
                   "added_ms_p50": _round(_pct(added, 50)), "added_ms_p99": _round(_pct(added, 99)),
                   "decision_ms_p50": _round(dec[0] * 1000 if dec[0] is not None else None, 4),
                   "decision_ms_p99": _round(dec[1] * 1000 if dec[1] is not None else None, 4),
                   "features_ms_p50": _round(feat[0] * 1000 if feat[0] is not None else None, 4),
                   "features_ms_p99": _round(feat[1] * 1000 if feat[1] is not None else None, 4),
                   "admission_polls_per_s_idle": _round(idle_polls_per_s, 1),
                   "admission_polls_per_s": _round((counted(m1, POLLS) - counted(m0, POLLS)) / wall, 1),
                   "router_cpu_ms_per_request": _round(1000 * (cpu - idle_cpu_per_s * wall) / max(1, len(ok))),
                   "router_cpu_ms_per_request_gross": _round(1000 * cpu / max(1, len(ok))),
                   "router_idle_cpu_per_s": _round(idle_cpu_per_s, 4),
                   "router_cpu_cores": _round(cpu / wall, 3),
                   "emulator_cpu_cores": _round(emu_cpu / wall, 3),
                   "send_late_ms_p99": _round(_pct(late, 99)), "router_fit_at_end": fit, "loadavg_1m": round(os.getloadavg()[0], 2)}
            row["within_target"] = bool(row["added_ms_p99"] is not None and row["added_ms_p99"] <= added_p99_ms
                                        and row["errors"] == 0)
            row["generator_kept_up"] = bool(row["send_late_ms_p99"] is not None and row["send_late_ms_p99"] <= 5.0)
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


def _round(x, nd: int = 3):
    return None if x is None else round(float(x), nd)


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
                    fit = router_fit(http_port)
            ok = [s for s in items if s.error is None]
            lat = np.array([(s.done - s.sent) / time_scale for s in ok])
            # what the router and the wire added in this run (wall ms; x 1/time_scale in the trace's time)
            added = [(s.done - s.sent - s.service_s) * 1000 for s in ok if s.service_s is not None]
            late = [(s.sent - s.at) * 1000 for s in items if s.sent is not None]
            row = {"kind": "policy", "emulated_instances": True, "instances": workers, "policy": policy,
                   "load": load, "rate": round(rate, 3), "requests": n, "ok": len(ok), "errors": n - len(ok),
                   "error_kinds": _kinds(items), "time_scale": time_scale,
                   "p95_s": _round(_pct(lat, 95)), "mean_s": _round(lat.mean() if len(lat) else None),
                   "p50_s": _round(_pct(lat, 50)),
                   "sim_p95_s": _round(np.percentile(slat, 95)), "sim_mean_s": _round(slat.mean()),
                   "sim_p50_s": _round(np.percentile(slat, 50)),
                   "misses": sum(not (s.cache_hit) for s in ok), "sim_misses": sim["misses"],
                   "added_ms_p50": _round(_pct(added, 50)), "added_ms_p99": _round(_pct(added, 99)),
                   "send_late_ms_p99": _round(_pct(late, 99)), "router_fit_at_end": fit,
                   "router_cpu_cores": _round(cpu / wall, 3), "emulator_cpu_cores": _round(emu_cpu / wall, 3),
                   "wall_s": round(wall, 1), "loadavg_1m": round(os.getloadavg()[0], 2)}
            if row["p95_s"]:
                row["p95_sim_over_real"] = _round(row["sim_p95_s"] / row["p95_s"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    for load in loads:  # predicted against the best of the others, through the router and in the simulator
        at = {r["policy"]: r for r in rows if r["load"] == load}
        others = [p for p in at if p != "predicted"]
        if "predicted" in at and others and all(at[p]["p95_s"] for p in at):
            best = min(others, key=lambda p: at[p]["p95_s"])
            best_sim = min(others, key=lambda p: at[p]["sim_p95_s"])
            rows.append({"kind": "policy_summary", "emulated_instances": True, "instances": workers, "load": load,
                         "best_baseline": best, "predicted_vs_best_p95": _round(at["predicted"]["p95_s"] /
                                                                                at[best]["p95_s"] - 1),
                         "sim_best_baseline": best_sim,
                         "sim_predicted_vs_best_p95": _round(at["predicted"]["sim_p95_s"] /
                                                             at[best_sim]["sim_p95_s"] - 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6))
    for n in sorted({r["instances"] for r in rows if r["kind"] == "overhead"}):
        rs = sorted([r for r in rows if r["kind"] == "overhead" and r["instances"] == n], key=lambda r: r["rate"])
        axes[0].plot([r["rate"] for r in rs], [r["added_ms_p99"] for r in rs], marker="o", label=f"{n} P99")
        axes[0].plot([r["rate"] for r in rs], [r["added_ms_p50"] for r in rs], marker=".", ls="--",
                     label=f"{n} P50")
    axes[0].axhline(5.0, color="grey", lw=0.8)
    axes[0].set(xlabel="offered rate (req/s)", ylabel="router-added latency (ms)", xscale="log",
                title="real router in front of emulated Triton instances")
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, nargs="*", default=[32, 128], help="cluster sizes of the overhead runs")
    ap.add_argument("--rates", type=float, nargs="*", default=[25, 50, 100, 200, 400, 800],
                    help="offered rates of the overhead ladder (req/s), in order; stops past the target")
    ap.add_argument("--window-s", type=float, default=20.0, help="seconds of sending per rate")
    ap.add_argument("--policy", default="predicted", help="the overhead runs' policy")
    ap.add_argument("--overhead-time-scale", type=float, default=0.02, help="emulated durations in the overhead "
                    "runs (short: the router, not the instances, is what is measured)")
    ap.add_argument("--steps", type=int, default=8, help="steps per request in the overhead runs")
    ap.add_argument("--added-p99-ms", type=float, default=5.0)
    ap.add_argument("--router-args", default="", help="extra router arguments for the overhead runs")
    ap.add_argument("--compare-workers", type=int, default=32, help="emulated instances of the policy runs (0: none)")
    ap.add_argument("--loads", type=float, nargs="*", default=[0.8, 0.95])
    ap.add_argument("--policies", nargs="*", default=list(COMPARED))
    ap.add_argument("--requests", type=int, default=4000, help="trace requests per policy and load")
    ap.add_argument("--time-scale", type=float, default=0.1, help="the policy runs' time compression")
    ap.add_argument("--lora-library", type=int, default=32, help="adapters the trace's num_lora are drawn from")
    ap.add_argument("--streams", type=int, default=8, help="client streams the load generator multiplexes over")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "router_scale.json")
    args = ap.parse_args(argv)
    profile = args.profile or default_profile()
    from maskedit_common.cost_model import CostModel

    resolution = int(CostModel.load_file(profile).meta.get("resolution") or 512)
    payloads = Payloads(resolution)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="maskedit-router-scale-") as tmp:
        tmp = Path(tmp)
        for n in args.instances:
            rows += overhead(n, args.rates, args.window_s, tmp, profile, args.policy, args.overhead_time_scale,
                             args.added_p99_ms, payloads, args.streams, args.steps, args.router_args.split())
        if args.compare_workers:
            rows += compare(args.compare_workers, args.loads, args.policies, args.requests, tmp, profile,
                            args.time_scale, payloads, args.streams, args.lora_library)
    summary = {}
    for n in args.instances:
        ok = [r["rate"] for r in rows if r["kind"] == "overhead" and r["instances"] == n and r["within_target"]
              and r["generator_kept_up"]]
        summary[str(n)] = {"max_rate_added_p99_within_target": max(ok) if ok else None}
    doc = {"meta": {"command": "python -m maskedit_lab.routing.scale " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:]),
                    "instances": "emulated (maskedit_lab.routing.triton_emulator): Triton's gRPC protocol, step times "
                                 "from the calibrated cost model, no accelerator",
                    "profile": profile.name, "resolution": resolution, "added_p99_target_ms": args.added_p99_ms,
                    "overhead_time_scale": args.overhead_time_scale, "time_scale": args.time_scale,
                    "router": "python -m maskedit_router (its own process), defaults unless router_args",
                    "router_args": args.router_args, "streams": args.streams,
                    "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                             "loadavg_1m_end": round(os.getloadavg()[0], 2)},
                    "wall_s": round(time.time() - started, 1), "summary": summary},
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(json.dumps(summary))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
