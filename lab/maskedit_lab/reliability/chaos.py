"""`python -m maskedit_lab.reliability.chaos` (`make chaos`): faults injected at a random moment under open-loop load
through the router, with what every request ended in.

    python -m maskedit_lab.reliability.chaos        # every fault, 2 instances, JSON + plot in perf_profiles/results
    python -m maskedit_lab.reliability.chaos --faults kill_server --duration 60

Per fault: requests sent / ok / failed by code / lost (no result and no error), P95 before, during and after the
fault, time to recover (every backend back in rotation; for the router, answering again), and what was left
behind (processes, /dev/shm regions, ports of the parts that were killed). Targets: 0 lost; recovery within 30 s
of the restart; nothing left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np

from loadgen import runner, workload
from loadgen.records import Record
from maskedit.cache.store import from_settings
from maskedit.settings import REPO_ROOT
from maskedit_client import EditClient

from .topology import Topology, running_topology

RESULTS = REPO_ROOT / "perf_profiles" / "results"


# -- faults: each runs in its own thread while the load goes on, and returns when the fault is over -------------
def kill_server(topo: Topology, rng: random.Random) -> dict:
    """kill -9 of one backend's tritonserver (its stubs are orphaned); the supervisor reaps and restarts it."""
    i = rng.randrange(len(topo.servers))
    inst = topo.supervisor.instances[i]
    before = inst.recoveries
    os.kill(topo.servers[i].proc.pid, signal.SIGKILL)
    return {"target": f"server{i}", **_await_restart(inst, before)}


def kill_denoise_stub(topo: Topology, rng: random.Random) -> dict:
    """kill -9 of one backend's masked_denoise stub (Triton 2.51 keeps saying ready and does not restart it): the
    supervisor reloads that model alone (explicit model control), else restarts the server."""
    i = rng.randrange(len(topo.servers))
    inst = topo.supervisor.instances[i]
    before = inst.recoveries
    pid = next(pid for pid, stub in inst.stubs.items() if stub.model == "masked_denoise")
    os.kill(pid, signal.SIGKILL)
    return {"target": f"server{i}/masked_denoise stub", **_await_restart(inst, before)}


def sigstop_server(topo: Topology, rng: random.Random, hang_s: float = 10.0) -> dict:
    """SIGSTOP of one backend's tritonserver for ``hang_s``, then SIGCONT: a hang, not a crash."""
    i = rng.randrange(len(topo.servers))
    pid = topo.servers[i].proc.pid
    os.kill(pid, signal.SIGSTOP)
    time.sleep(hang_s)
    os.kill(pid, signal.SIGCONT)
    return {"target": f"server{i}", "restored": time.perf_counter()}


def restart_router(topo: Topology, rng: random.Random, down_s: float = 2.0) -> dict:
    """kill -9 of the router process, started again on its port ``down_s`` later."""
    topo.kill_router()
    time.sleep(down_s)
    topo.start_router()
    return {"target": "router", "restored": time.perf_counter()}


def sigstop_router(topo: Topology, rng: random.Random, hang_s: float = 30.0) -> dict:
    """SIGSTOP of the router process for ``hang_s``, then SIGCONT: the clients' requests wait meanwhile; after it
    none may be refused for load the stall made up, and no backend taken out of rotation for the silence."""
    pid = topo.router.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(hang_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return {"target": "router", "restored": time.perf_counter(), "hang_s": hang_s}


def fill_memory_tier(topo: Topology, rng: random.Random, entry_mb: int = 8) -> dict:
    """Fill one backend's activation-store memory tier to its limit with entries nobody asks for: the store must
    evict (to disk) and keep serving."""
    i = rng.randrange(len(topo.servers))
    cache = topo.servers[i].settings.cache  # the server's own store: its directories and sizes
    budget = cache.mem_bytes
    store = from_settings(cache)
    filler = np.random.default_rng(0).standard_normal(entry_mb << 18, dtype=np.float32)
    written = 0
    while written < budget:
        store.put(f"chaos-filler-{rng.getrandbits(48):012x}", {"x": filler}, {"filler": True})
        written += filler.nbytes
    return {"target": f"server{i}", "restored": time.perf_counter(), "written_mb": written >> 20,
            "mem_bytes_after": store.tier_bytes()["mem"], "budget_bytes": budget}


FAULTS = {f.__name__: f for f in (kill_server, kill_denoise_stub, sigstop_server, restart_router, sigstop_router,
                                  fill_memory_tier)}


def _await_restart(inst, before: int, timeout_s: float = 300.0) -> dict:
    """Until the supervisor brought ``inst`` back (a restart or a model reload)."""
    deadline = time.perf_counter() + timeout_s
    while inst.recoveries == before and time.perf_counter() < deadline:
        time.sleep(0.1)
    ev = inst.events[-2:]
    return {"restored": time.perf_counter() if inst.recoveries > before else None,
            "supervisor": [e[1] for e in ev], "how": "reload" if inst.total_reloads and "reloaded" in ev[-1][1]
            else "restart", "reaped_to_ready_s": round(ev[-1][0] - ev[0][0], 1) if len(ev) == 2 else None}


# -- one case -----------------------------------------------------------------------------------------------
def run_case(topo: Topology, fault: str, rate: float, duration_s: float, seed: int = 0, templates: int = 8,
             steps: int | None = None, progress: bool = True, recover_timeout_s: float = 120.0,
             faults: dict | None = None, sink: dict | None = None, recovered=None) -> dict:
    """Open-loop load at ``rate`` for ``duration_s`` through the router; ``fault`` (a name in ``faults``, default
    this module's) injected at a random moment in the first half. Waits (up to ``recover_timeout_s`` more) for
    recovery before judging: ``recovered()`` true (default: every backend in rotation). ``sink``: filled with the
    requests, records, answers' PNGs and the start time."""
    recovered = recovered or topo.all_in_rotation
    faults = faults or FAULTS
    sink = {} if sink is None else sink
    sink["images"] = {}
    rng = random.Random(seed)
    reqs = workload.poisson(rate, max(1, int(rate * duration_s)), n_templates=templates, steps=steps, seed=seed)
    sink["requests"] = reqs
    at = rng.uniform(0.25, 0.45) * reqs[-1].t
    times: dict = {}
    box: dict = {}

    started = threading.Event()
    t0 = 0.0

    def on_start(t):
        nonlocal t0
        t0 = t
        started.set()

    def inject():
        if not started.wait(600):
            return
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        times["injected"] = time.perf_counter()
        try:
            box.update(faults[fault](topo, rng))
        except Exception as e:  # reported with the case, which then cannot meet its targets
            box["error"] = f"{type(e).__name__}: {e}"
        restored = box.get("restored") or time.perf_counter()
        deadline = time.perf_counter() + recover_timeout_s
        while time.perf_counter() < deadline:  # full capacity: every backend serving again, the router answering
            if recovered():
                times["recovered"] = time.perf_counter()
                break
            time.sleep(0.2)
        times["restored"] = restored

    assets = runner.Assets(256)
    for r in reqs:  # encoded before the clock starts, so the sender keeps its schedule
        assets.template(r.template)
    th = threading.Thread(target=inject, name=f"fault-{fault}")
    th.start()
    with EditClient(topo.url, api_key=topo.api_key) as client:  # keys on: the run's key
        records, wall = runner.run(client, reqs, assets, timeout_s=60.0, progress=progress, on_start=on_start,
                                   images=sink["images"])
    sink.update(records=records, t0=t0)
    th.join(recover_timeout_s + 330)
    topo.remember()  # a restart made a new generation: its predecessor must have left nothing
    return summarize_case(fault, records, wall, t0, times, box, topo.leftovers(), rate)


def summarize_case(fault: str, records: list[Record], wall: float, t0: float, times: dict, box: dict,
                   leftovers: dict, rate: float) -> dict:
    inj = times.get("injected", t0) - t0
    rec = times.get("recovered")
    rec_s = None if rec is None else rec - t0
    codes: dict[str, int] = {}
    for r in records:
        if r.error:
            codes[r.error_code] = codes.get(r.error_code, 0) + 1

    def p95(sel):
        lat = [r.latency_s for r in records if r.latency_s is not None and sel(r.submit_s)]
        return round(float(np.percentile(lat, 95)), 3) if lat else None

    end = rec_s if rec_s is not None else float("inf")
    restored = times.get("restored")
    return {
        "fault": fault, "rate": rate, "wall_s": round(wall, 1), "injected_at_s": round(inj, 2),
        "sent": len(records), "ok": sum(r.error is None and r.done_s is not None for r in records),
        "failed_by_code": {k: v for k, v in codes.items() if k != runner.LOST},
        "lost": codes.get(runner.LOST, 0),
        "p95_before_s": p95(lambda s: s < inj), "p95_during_s": p95(lambda s: inj <= s < end),
        "p95_after_s": p95(lambda s: s >= end),
        "time_to_recover_s": None if rec is None else round(rec - times["injected"], 2),
        "recovered_at_s": None if rec_s is None else round(rec_s, 2),
        "recovered_after_restart_s": None if rec is None or restored is None else round(max(0.0, rec - restored), 2),
        "fault_detail": {k: (round(v - t0, 2) if k == "restored" and v else v) for k, v in box.items()},
        "leftovers": leftovers,
        "met": {"fault_injected": "error" not in box, "zero_lost": codes.get(runner.LOST, 0) == 0,
                "recovered_within_30s_of_restart": rec is not None and (restored is None or rec - restored <= 30),
                "nothing_left": not any(leftovers.values())},
    }


# -- the command --------------------------------------------------------------------------------------------
def plot(cases: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    names = [c["fault"] for c in cases]
    x = np.arange(len(cases))
    for k, (key, lab) in enumerate((("p95_before_s", "before"), ("p95_during_s", "during"), ("p95_after_s", "after"))):
        axes[0].bar(x + (k - 1) * 0.27, [c[key] or 0 for c in cases], 0.27, label=lab)
    axes[0].set(xticks=x, ylabel="P95 latency (s)", title="P95 before / during / after the fault")
    axes[0].set_xticklabels(names, rotation=15, fontsize=8)
    axes[0].legend(fontsize=8)
    bottom = np.zeros(len(cases))
    ok = np.array([c["ok"] for c in cases], float)
    axes[1].bar(x, ok, label="ok")
    bottom += ok
    for code in sorted({k for c in cases for k in c["failed_by_code"]}):
        v = np.array([c["failed_by_code"].get(code, 0) for c in cases], float)
        axes[1].bar(x, v, bottom=bottom, label=code)
        bottom += v
    lost = np.array([c["lost"] for c in cases], float)
    axes[1].bar(x, lost, bottom=bottom, label="lost", color="black")
    axes[1].set(xticks=x, ylabel="requests", title="how every request ended")
    axes[1].set_xticklabels(names, rotation=15, fontsize=8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--rate", type=float, default=2.0, help="open-loop arrivals per second through the router")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of load per fault")
    ap.add_argument("--mem-mb", type=int, default=128, help="each instance's activation-store memory budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-keys", action="store_true", help="the router with a key file: every request sent with "
                    "a key (the same faults and targets with keys on)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "chaos")
    ap.add_argument("--result", type=Path, default=RESULTS / "chaos.json")
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"--faults: unknown {unknown}; choose from {list(FAULTS)}")
    env = {"MASKEDIT_CACHE_MEM_BYTES": str(args.mem_mb << 20)}
    cases = []
    t_start = time.time()
    with running_topology(args.instances, args.out, env, keys=args.api_keys) as topo:
        for k, fault in enumerate(faults):
            print(f"[{k + 1}/{len(faults)}] {fault} at {args.rate} req/s for {args.duration:g} s", flush=True)
            case = run_case(topo, fault, args.rate, args.duration, seed=args.seed + k)
            cases.append(case)
            print(json.dumps({k: case[k] for k in ("fault", "sent", "ok", "failed_by_code", "lost", "p95_before_s",
                                                  "p95_during_s", "p95_after_s", "time_to_recover_s",
                                                  "recovered_after_restart_s", "met")}), flush=True)
            _settle(topo)
    final = topo.leftovers()
    result = {
        "command": "python -m maskedit_lab.reliability.chaos " + " ".join(argv if argv is not None
                                                                         else __import__("sys").argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "note": "2 CPU cores shared with other work during the run"},
        "instances": args.instances, "rate": args.rate, "duration_s": args.duration, "api_keys": args.api_keys,
        "cases": cases,
        "leftovers_after_shutdown": final,
        "all_met": all(all(c["met"].values()) for c in cases) and not any(final.values()),
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1))
    plot(cases, args.result.with_suffix(".png"))
    print(f"wrote {args.result} and {args.result.with_suffix('.png')}; all targets met: {result['all_met']}")


def _settle(topo: Topology, timeout_s: float = 120.0) -> None:
    """Between cases: every backend in rotation again, so one fault's recovery does not spill into the next."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and not topo.all_in_rotation():
        time.sleep(0.5)


if __name__ == "__main__":
    main()
