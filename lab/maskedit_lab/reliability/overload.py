"""`python -m maskedit_lab.reliability.overload` (`make overload`): open-loop load at twice capacity, straight to one
server and through the router; every refused request must get RESOURCE_EXHAUSTED on its own stream within a second.
Then a flood: 160 requests within a second straight at one server (no router in front), each answered or refused within
10 s of its arrival, none lost (the servers run with that bound, ``MASKEDIT_LATENCY_BOUND_S``: ``--latency-bound-s``).

    python -m maskedit_lab.reliability.overload                 # capacity, then 2x; JSON + plot: perf_profiles/results
    python -m maskedit_lab.reliability.overload --ab-pairs 3    # then 3 pairs through the router, admission on / off
    python -m maskedit_lab.reliability.overload --phases flood  # the flood alone (figures about correctness: any host)

Capacity is what the target completes per second under a load well past it. Reported per target: sent, ok,
refused (RESOURCE_EXHAUSTED), other errors by code, lost (no result and no error), how long refusals took
(max, P99, share within 1 s), who refused (``refusal_source``) with the slowest refusal of each, what was served
per second and the P95 of the requests that were served.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import time
from pathlib import Path

import numpy as np

from maskedit.settings import REPO_ROOT
from maskedit_common import backend_guard

from . import capacity
from .topology import running_topology

RESULTS = REPO_ROOT / "perf_profiles" / "results"


SOURCES = (  # who refused, from the refusal's text (router/maskedit_router/proxy/server.py, maskedit/admission.py)
    ("router_admission", re.compile(r"no backend can admit it")),  # the router, at once: every backend's queue full
    ("router_timeout", re.compile(r"refused by the router")),  # the router, for a request left waiting at a backend
    ("router_inflight", re.compile(r"in flight|in-flight limit")),  # the router's in-flight limits
)


BACKEND_SOURCES = (  # which of a backend's checks refused (maskedit.intake, maskedit.completion, maskedit.scheduler, maskedit.admission)
    ("intake_full", re.compile(r"pre-processing's queue is full")),  # intake, on arrival: 16 wait for pre-processing
    ("triton_queue", re.compile(r"Exceeds maximum queue size")),  # Triton's queue policy (servers before intake)
    ("bound_front", re.compile(r"refused before any work")),  # the time bound, before pre-processing did any work
    ("bound_denoise", re.compile(r"refused before denoising")),  # the time bound, when denoise received it
    ("bound_queue", re.compile(r"refused before it started")),  # the time bound, at the front of the denoise queue
    ("queue_full", re.compile(r"denoise queue is full")),  # the count bound
)


ENDED = re.compile(r"ran out of its bound")  # maskedit.scheduler.BatchScheduler.overdue


def backend_source(message: str) -> str:
    """Which check of a backend refused a request (``BACKEND_SOURCES``), else ``refusal_source``."""
    for name, pattern in BACKEND_SOURCES:
        if pattern.search(message or ""):
            return name
    return refusal_source(message)


def refusal_source(message: str) -> str:
    """``router_admission``, ``router_timeout``, ``router_inflight``, or ``backend`` (its admission check at
    pre-processing, or its denoise loop)."""
    for name, pattern in SOURCES:
        if pattern.search(message or ""):
            return name
    return "backend"


def judge(recs: list, summary: dict, rate: float, cap: float) -> dict:
    refused = [r.answered_after_s for r in recs if r.error_code == "RESOURCE_EXHAUSTED"]
    by: dict[str, list] = {}
    for r in recs:
        if r.error_code == "RESOURCE_EXHAUSTED":
            by.setdefault(refusal_source(r.error), []).append(r.answered_after_s)
    other = {k: v for k, v in summary["errors"].items() if k not in ("RESOURCE_EXHAUSTED", "LOST")}
    return {
        "rate": round(rate, 2), "capacity": round(cap, 2), "sent": summary["requests"], "ok": summary["completed"],
        "refused": len(refused), "other_errors": other, "lost": summary["lost"],
        "refusal_max_s": round(max(refused), 3) if refused else None,
        "refusal_p99_s": round(float(np.percentile(refused, 99)), 3) if refused else None,
        "refused_within_1s": round(float(np.mean(np.array(refused) < 1.0)), 4) if refused else None,
        "refused_by": {k: {"n": len(v), "max_s": round(max(v), 3)} for k, v in sorted(by.items())},
        "ok_p95_s": summary["p95_s"], "throughput": summary["throughput"],
        "met": {"nothing_lost": summary["lost"] == 0, "only_refusals": not other,
                "refusals_within_1s": bool(refused) and max(refused) < 1.0},
    }


ADMISSION_OFF = ["--admission-wait-s", "0"]


def flood(url: str, n: int = 160, spread_s: float = 1.0, steps: int = 30, within_s: float = 10.0, seed: int = 3,
          headers: dict | None = None, deadline_ms: int | None = None) -> tuple[list, dict]:
    """``n`` requests within ``spread_s`` (Poisson arrivals) straight at ``url``, as a client with no router in
    front would send them: each must be answered (a result) or refused (RESOURCE_EXHAUSTED) within ``within_s`` of
    its arrival. ``late``: answered after that; ``lost``: no answer at all (2 minutes after the last send).
    ``headers``: more metadata (a guarded backend's key); ``deadline_ms``: each request's DEADLINE_MS (a request
    that would miss it with nothing ahead of it is refused DEADLINE_EXCEEDED). Who refused: ``backend_source``."""
    from maskedit_client import EditClient

    from loadgen import records, runner, workload

    load_before = os.getloadavg()
    reqs = workload.poisson(n / spread_s, n, steps=steps, seed=seed, deadline_ms=deadline_ms)
    with EditClient(url, headers=headers, retry=False) as c:
        recs, wall = runner.run(c, reqs, runner.Assets(256), timeout_s=120.0, progress=True)
    s = records.summarize(recs, wall)
    answered = [r.answered_after_s for r in recs if r.error_code != runner.LOST and r.answered_after_s is not None]
    refused = [r.answered_after_s for r in recs if r.error_code == "RESOURCE_EXHAUSTED"]
    # admitted, then ended before a step that would have taken it past its bound (the host turned slower than
    # predicted): an answer within the bound, not a result
    ended = [r.answered_after_s for r in recs if r.error_code == "DEADLINE_EXCEEDED" and ENDED.search(r.error or "")]
    ok = [r.latency_s for r in recs if r.latency_s is not None]
    # with DEADLINE_MS every DEADLINE_EXCEEDED is an answer (a deadline missed even with nothing ahead is refused)
    known = {"RESOURCE_EXHAUSTED": len(refused), runner.LOST: s["lost"],
             "DEADLINE_EXCEEDED": s["errors"].get("DEADLINE_EXCEEDED", 0) if deadline_ms else len(ended)}
    other = {k: v - known.get(k, 0) for k, v in s["errors"].items() if v > known.get(k, 0)}
    late = sum(a > within_s for a in answered)
    by: dict[str, list] = {}
    for r in recs:
        if r.error_code == "RESOURCE_EXHAUSTED":
            by.setdefault(backend_source(r.error), []).append(r.answered_after_s)
    out = {
        "sent": n, "spread_s": spread_s, "steps": steps, "within_s": within_s, "deadline_ms": deadline_ms,
        "ok": len(ok), "refused": len(refused), "deadline_exceeded": s["errors"].get("DEADLINE_EXCEEDED", 0),
        "ended_at_bound": len(ended), "ended_max_s": round(max(ended), 3) if ended else None,
        "other_errors": other, "late": late, "lost": s["lost"],
        "answered_max_s": round(max(answered), 3) if answered else None,
        "ok_max_s": round(max(ok), 3) if ok else None, "ok_p95_s": s["p95_s"],
        "refusal_max_s": round(max(refused), 3) if refused else None,
        "refusal_p99_s": round(float(np.percentile(refused, 99)), 3) if refused else None,
        "refused_by": {k: {"n": len(v), "max_s": round(max(v), 3)} for k, v in sorted(by.items())},
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "met": {"all_within": late == 0 and s["lost"] == 0 and len(answered) == n, "nothing_lost": s["lost"] == 0,
                "only_refusals": not other},
    }
    return recs, out


def ab(topo, rate: float, duration_s: float, pairs: int, steps: int) -> list[dict]:
    """``pairs`` pairs of runs through the router at ``rate``, its own admission on, then off (each backend decides
    alone, as before it had any), interleaved so both see the same host; the two runs of a pair send the same
    arrivals. The router process is restarted with the other arguments between runs."""
    own = list(topo.router_args)
    rows = []
    try:
        for i in range(pairs):
            for mode, extra in (("on", own), ("off", own + ADMISSION_OFF)):
                topo.stop_router()
                topo.router_args = extra
                topo.start_router()
                recs, s = capacity.run_at(topo.url, rate, duration_s, steps=steps, seed=10 + i)
                j = judge(recs, s, rate, rate / 2)
                rows.append({"pair": i, "admission": mode, **{k: j[k] for k in (
                    "sent", "ok", "refused", "refused_by", "lost", "refusal_max_s", "refused_within_1s", "ok_p95_s")},
                    "served": round(j["throughput"], 2)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        topo.stop_router()
        topo.router_args = own
        topo.start_router()
    return rows


def router_outcomes(topo) -> dict:
    """What the backends did with the requests the router refused on their behalf (its metrics): ``dropped``
    (cancelled before pre-processing), ``refused_there`` (reached the check first and refused) or ``admitted``
    (passed the check first: the cancel came late or the router's count was wrong; dropped in the denoise loop)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{topo.http_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r'^maskedit_router_admission_timeout_outcome_total\{[^}]*where="(\w+)"[^}]*\} ([\d.e+]+)$',
                         text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0) + int(float(m.group(2)))
    return out


def plot(result: dict, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.2), squeeze=False)
    for ax, (name, recs) in zip(axes[0], runs.items()):
        ok = [(r.submit_s, r.latency_s) for r in recs if r.latency_s is not None]
        ref = [(r.submit_s, r.answered_after_s) for r in recs if r.error_code == "RESOURCE_EXHAUSTED"]
        ended = [(r.submit_s, r.answered_after_s) for r in recs
                 if r.error_code == "DEADLINE_EXCEEDED" and ENDED.search(r.error or "")]
        if ok:
            ax.scatter(*zip(*ok), s=6, label="served: latency")
        if ref:
            ax.scatter(*zip(*ref), s=6, c="red", label="refused: time to RESOURCE_EXHAUSTED")
        if ended:
            ax.scatter(*zip(*ended), s=10, c="orange", marker="x", label="ended at its bound (DEADLINE_EXCEEDED)")
        if name == "flood":
            j = result["flood"]
            ax.axhline(j["within_s"], ls="--", c="gray", lw=0.8)
            bound = f", bound {result['latency_bound_s']:g} s" if result.get("latency_bound_s") else ""
            ax.set(xlabel="send time (s)", ylabel="seconds", title=f"flood: {j['sent']} requests in {j['spread_s']:g} s "
                   f"at one server, {j['steps']} steps{bound}\n{j['ok']} ok, {j['refused']} refused, "
                   f"{j.get('ended_at_bound', 0)} ended at its bound, {j['late']} late, {j['lost']} lost")
        else:
            ax.axhline(1.0, ls="--", c="gray", lw=0.8)
            j = result["targets"][name]
            ax.set(xlabel="send time (s)", ylabel="seconds", title=f"{name}: {j['rate']} req/s = 2x capacity "
                   f"{j['capacity']}; {j['ok']} ok, {j['refused']} refused, {j['lost']} lost")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--probe-rate", type=float, default=12.0, help="load used to measure capacity (well past it)")
    ap.add_argument("--probe-s", type=float, default=30.0)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds at 2x capacity per target")
    ap.add_argument("--steps", type=int, default=30, help="denoising steps per request")
    ap.add_argument("--max-queue", type=int, default=8, help="each server's denoise queue (MASKEDIT_MAX_QUEUE)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "overload")
    ap.add_argument("--result", type=Path, default=RESULTS / "overload.json")
    ap.add_argument("--router-args", default="", help="extra router arguments, e.g. '--admission-wait-s 0' for the "
                    "router without its own admission (each backend decides alone)")
    ap.add_argument("--ab-pairs", type=int, default=0, help="then this many pairs of runs through the router at 2x "
                    "its capacity with its own admission on and off, interleaved (what it costs or gains)")
    ap.add_argument("--ab-duration", type=float, default=45.0, help="seconds per run of a pair")
    ap.add_argument("--phases", default="server,router,flood", help="which to run, of server (2x capacity straight "
                    "at one server), router (2x capacity through the router), flood (below)")
    ap.add_argument("--flood", type=int, default=160, help="requests of the flood straight at one server")
    ap.add_argument("--flood-spread-s", type=float, default=1.0, help="the flood's requests arrive within this")
    ap.add_argument("--flood-within-s", type=float, default=10.0, help="each must be answered or refused within this")
    ap.add_argument("--flood-steps", type=int, default=None, help="denoising steps of the flood's requests (default: "
                    "--steps)")
    ap.add_argument("--flood-deadline-ms", type=int, default=None, help="DEADLINE_MS on each of the flood's requests "
                    "(default: none, as the probe that found the problem sent them)")
    ap.add_argument("--latency-bound-s", type=float, default=None, help="the servers' MASKEDIT_LATENCY_BOUND_S "
                    "(every request answered or refused within it; default: --flood-within-s when the flood runs, "
                    "else the servers' default; 0: none)")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - {"server", "router", "flood"}
    if unknown:
        ap.error(f"--phases: unknown {', '.join(sorted(unknown))} (server, router, flood)")
    env = {"MASKEDIT_MAX_QUEUE": str(args.max_queue)}
    bound = args.latency_bound_s if args.latency_bound_s is not None else \
        (args.flood_within_s if "flood" in phases else None)
    if bound is not None:
        env["MASKEDIT_LATENCY_BOUND_S"] = f"{bound:g}"
    started = time.time()
    result = {"command": "python -m maskedit_lab.reliability.overload " + " ".join(argv if argv is not None else
                                                                  __import__("sys").argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "steps": args.steps,
              "max_queue": args.max_queue, "latency_bound_s": bound, "instances": args.instances,
              "router_args": args.router_args,
              "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "note": args.note}, "targets": {}}
    runs = {}
    with running_topology(args.instances, args.out, env, shlex.split(args.router_args)) as topo:
        for name, url, probe in (("server", topo.servers[0].grpc_url, args.probe_rate / args.instances),
                                 ("router", topo.url, args.probe_rate)):
            if name not in phases:
                continue
            print(f"{name}: capacity at {probe:g} req/s offered", flush=True)
            _, s = capacity.run_at(url, probe, args.probe_s, steps=args.steps, seed=1)
            cap = capacity.capacity([s])
            print(f"{name}: capacity {cap:.2f} req/s; overload at {2 * cap:.2f} req/s", flush=True)
            recs, s2 = capacity.run_at(url, 2 * cap, args.duration, steps=args.steps, seed=2, progress=True)
            result["targets"][name] = judge(recs, s2, 2 * cap, cap)
            if name == "router":
                time.sleep(2)  # the backends' answers to what the router refused on their behalf
                result["targets"][name]["router_refusals_at_backend"] = router_outcomes(topo)
            runs[name] = recs
            print(json.dumps(result["targets"][name]), flush=True)
        if "flood" in phases:
            server = topo.servers[0]
            key = server.backend_key
            print(f"flood: {args.flood} requests within {args.flood_spread_s:g} s straight at {server.grpc_url}",
                  flush=True)
            recs, result["flood"] = flood(server.grpc_url, args.flood, args.flood_spread_s,
                                          args.flood_steps or args.steps, args.flood_within_s,
                                          headers=dict(backend_guard.grpc_metadata(key)),
                                          deadline_ms=args.flood_deadline_ms)
            runs["flood"] = recs
            print(json.dumps(result["flood"]), flush=True)
        if args.ab_pairs:
            rate = result["targets"]["router"]["rate"]
            print(f"router admission on / off: {args.ab_pairs} pairs at {rate:g} req/s", flush=True)
            result["router_ab"] = ab(topo, rate, args.ab_duration, args.ab_pairs, args.steps)
        topo.remember()
    result["leftovers_after_shutdown"] = topo.leftovers()
    result["all_met"] = all(all(t["met"].values()) for t in [*result["targets"].values(),
                                                             *([result["flood"]] if "flood" in result else [])])
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1))
    plot(result, runs, args.result.with_suffix(".png"))
    print(f"wrote {args.result} and {args.result.with_suffix('.png')}; all targets met: {result['all_met']}")


if __name__ == "__main__":
    main()
