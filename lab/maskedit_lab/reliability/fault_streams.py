"""Idle streams against the router: ``idle_streams`` holds 500 streams open that send nothing (from a client
process that then dies) while normal traffic runs, and compares that traffic's P95 with a quiet run.

    python -m maskedit_lab.reliability.fault_streams      # 2 instances + the router; JSON in perf_profiles/results
    python -m maskedit_lab.reliability.fault_streams --streams 500 --rate 2 --duration 40

Before the router served streams as coroutines (``maskedit_router.proxy.aio``), 64 idle streams took its 64 threads: a
new request waited 20 s, neither served nor refused. Target: the loaded P95 within 1.5x the quiet one, nothing lost, no
errors, and the dead client's streams freed (the router's open-stream count back where it was) within seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from loadgen import runner, workload
from maskedit.settings import REPO_ROOT
from maskedit_client import EditClient

from .topology import Topology, running_topology

RESULTS = REPO_ROOT / "perf_profiles" / "results"


# -- the idle client: its own process, so it can die as the did -------------------------------------------
async def hold(url: str, streams: int, connections: int) -> None:
    """Open ``streams`` ModelStreamInfer streams over ``connections`` connections and send nothing, forever."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    channels = [grpc.aio.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(connections)]
    calls = [service_pb2_grpc.GRPCInferenceServiceStub(channels[i % connections]).ModelStreamInfer()
             for i in range(streams)]
    await asyncio.sleep(3.0)
    ended = sum(c.done() for c in calls)
    print(json.dumps({"opened": streams, "ended_early": ended}), flush=True)
    await asyncio.Event().wait()


def _start_holder(url: str, streams: int, connections: int, out: Path) -> subprocess.Popen:
    log = open(out / "idle_streams_holder.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "maskedit_lab.reliability.fault_streams", "--hold", url,
                             "--streams", str(streams),
                             "--connections", str(connections)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    return proc


def _open_streams(topo: Topology) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{topo.http_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith('maskedit_router_streams_open{port="router"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_streams(topo: Topology, cond, timeout_s: float) -> float | None:
    """Seconds until the router's open-stream count satisfies ``cond`` (None: not within ``timeout_s``)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        n = _open_streams(topo)
        if n is not None and cond(n):
            return time.perf_counter() - t0
        time.sleep(0.1)
    return None


def _load(topo: Topology, reqs, assets, progress: bool) -> list:
    with EditClient(topo.url) as client:
        records, _ = runner.run(client, reqs, assets, timeout_s=60.0, progress=progress)
    return records


def _p(records, q) -> float | None:
    lat = [r.latency_s for r in records if r.latency_s is not None and r.error is None]
    return round(float(np.percentile(lat, q)), 3) if lat else None


# -- the fault --------------------------------------------------------------------------------------------------
def idle_streams(topo: Topology, streams: int = 500, connections: int = 10, rate: float = 2.0,
                 duration_s: float = 40.0, seed: int = 0, templates: int = 8, progress: bool = False) -> dict:
    """A quiet run, then the same requests with ``streams`` idle streams held open (over ``connections`` client
    connections, each under the router's per-connection limit) by another process; then that process is killed
    and the time until the router has freed its streams is ``recovery_s``. The row's counts are the loaded run's."""
    reqs = workload.poisson(rate, max(1, int(rate * duration_s)), n_templates=templates, seed=seed)
    assets = runner.Assets(256)
    with EditClient(topo.url) as client:  # both runs find every template recorded: only the streams differ
        for tid in sorted({r.template for r in reqs}):
            client.edit(assets.template(tid), assets.mask(reqs[0]), "warm up", steps=reqs[0].steps)
    baseline = _open_streams(topo) or 0.0
    quiet = _load(topo, reqs, assets, progress)
    holder = _start_holder(topo.url, streams, connections, topo.out)
    try:
        opened_s = _wait_streams(topo, lambda n: n >= baseline + streams, 60.0)
        loaded = _load(topo, reqs, assets, progress)
        held_after = _open_streams(topo)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the client dies with its streams open
        holder.wait(10)
    freed_s = _wait_streams(topo, lambda n: n <= baseline, 60.0)  # from the client's death
    recovery_s = None if freed_s is None else round(freed_s, 2)
    errors: dict[str, int] = {}
    for r in loaded:
        if r.error and r.error_code != runner.LOST:
            errors[r.error_code] = errors.get(r.error_code, 0) + 1
    p95_quiet, p95_loaded = _p(quiet, 95), _p(loaded, 95)
    row = {
        "fault": "idle_streams", "sent": len(loaded),
        "ok": sum(r.error is None and r.done_s is not None for r in loaded), "errors": sum(errors.values()),
        "lost": sum(r.error_code == runner.LOST for r in loaded), "corrupt_served": 0,
        "recovery_s": recovery_s, "p95_quiet_s": p95_quiet, "p95_loaded_s": p95_loaded, "errors_by_code": errors,
        "detail": {"streams": streams, "connections": connections, "rate": rate, "duration_s": duration_s,
                   "streams_open_before": baseline, "streams_open_while_loaded": held_after,
                   "all_open_after_s": None if opened_s is None else round(opened_s, 2),
                   "p50_quiet_s": _p(quiet, 50), "p50_loaded_s": _p(loaded, 50),
                   "quiet_errors": sum(1 for r in quiet if r.error)},
    }
    row["met"] = {"streams_held": opened_s is not None, "zero_lost": row["lost"] == 0,
                  "no_errors": row["errors"] == 0, "streams_freed": recovery_s is not None,
                  "p95_within_1_5x": None not in (p95_quiet, p95_loaded) and p95_loaded <= 1.5 * p95_quiet}
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold", metavar="URL", help="(internal) be the idle client: hold --streams streams on URL")
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--connections", type=int, default=10)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of load per run (quiet, then loaded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="what else ran on the host")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "fault_streams")
    ap.add_argument("--result", type=Path, default=RESULTS / "fault_streams.json")
    args = ap.parse_args(argv)
    if args.hold:
        asyncio.run(hold(args.hold, args.streams, args.connections))
        return
    t_start = time.time()
    # the router's OpenAI port off: 7003 may be taken on a shared host
    with running_topology(args.instances, args.out, router_args=["--openai-port", "0"]) as topo:
        row = idle_streams(topo, args.streams, args.connections, args.rate, args.duration, args.seed, progress=True)
        leftovers = topo.leftovers()
    result = {"command": "python -m maskedit_lab.reliability.fault_streams "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
              "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "note": args.note},
              "instances": args.instances, "row": row, "leftovers": leftovers}
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1))
    print(json.dumps(row, indent=1))
    print(f"wrote {args.result}; all targets met: {all(row['met'].values())}")


if __name__ == "__main__":
    main()
