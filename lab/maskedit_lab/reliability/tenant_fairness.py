"""`python -m maskedit_lab.reliability.tenant_fairness` (`make bench-tenants`): does one tenant's flood raise the
others' latency?

Real ``tritonserver`` instances behind the router process with a key file giving each tenant its own key. One
tenant, ``flood``, sends at 3x capacity while four light tenants send at 10 % of capacity each; their P95 with the
flood is compared with their P95 alone (``p95_alone_s``), in three set-ups run one after the other:

- ``router+backend``: fair share on (the router's fair queue, ``--fair-share-slots``, and each backend's denoise
  queue, ``MASKEDIT_FAIR_SHARE=1``): ``fair_share`` true;
- ``backend``: the router's queue off, only the backends share their queues by tenant (a flood that gets past the
  router): ``fair_share`` true;
- ``off``: first come, first served everywhere (``MASKEDIT_FAIR_SHARE=0``, no router queue): ``fair_share`` false.

Capacity is measured first (what the router completes per second under a load well past it, as
``overload`` does). Every request sent ends in a result or an error: ``refused`` (RESOURCE_EXHAUSTED,
an answer) is counted apart from ``lost`` (neither, by the time the last request's client would have given up
retrying it: ``drain_s``). The host's load average is recorded with each phase: the host is shared.

    python -m maskedit_lab.reliability.tenant_fairness    # JSON + plot in perf_profiles/results/tenants.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from loadgen import records, runner, workload
from maskedit.settings import REPO_ROOT
from maskedit_client import EditClient
from maskedit_router.__main__ import parser as router_parser

from . import capacity
from .overload import refusal_source
from .topology import running_topology

RESULTS = REPO_ROOT / "perf_profiles" / "results"
LIGHT = ("light1", "light2", "light3", "light4")
FLOOD = "flood"


LIGHT_SHARE, FLOOD_SHARE = 0.1, 3.0  # of capacity: each light tenant's rate, the flood's
CLIENT_TIMEOUT_S = 120.0  # each tenant's client retries a request that found no backend up (UNAVAILABLE) this long


def drain_s(client_timeout_s: float = CLIENT_TIMEOUT_S, router_retry_s: float | None = None) -> float:
    """How long a phase waits after its last send before a request with no answer counts as ``lost``. A request no
    backend can take is retried in the router for its retry budget (``--retry-budget-s``, from its arrival) and then
    answered UNAVAILABLE, which its client sends again until ``client_timeout_s`` after it first sent it; so its last
    answer may come up to both after its send. A phase once waited 60 s while its clients retried for 120 s: with
    the only backend refusing the router, the two requests holding the router's two fair-queue slots were still being
    retried (by the router, then by their clients) at the cut-off and counted lost, every other request refused."""
    if router_retry_s is None:
        router_retry_s = router_parser().get_default("retry_budget_s")
    return client_timeout_s + router_retry_s + 10.0  # (+ the last backoff, a busy host)


def mix(cap: float, duration_s: float, steps: int, flood: bool, seed: int = 7) -> list[workload.Request]:
    """The light tenants at 10 % of ``cap`` each (Poisson), and with ``flood`` the flood at 3x ``cap``, for
    ``duration_s`` of sending."""
    plan = [(t, LIGHT_SHARE * cap, seed + i) for i, t in enumerate(LIGHT)] + \
        ([(FLOOD, FLOOD_SHARE * cap, seed + 99)] if flood else [])
    out = []
    for tenant, rate, s in plan:
        for r in workload.poisson(rate, max(2, round(rate * duration_s)), n_templates=8, steps=steps, seed=s):
            r.tenant = tenant
            out.append(r)
    return sorted(out, key=lambda r: r.t)


def phase(topo, keys: dict, reqs: list, name: str) -> tuple[list, dict]:
    """Send ``reqs`` through the router, each with its tenant's key; (records, per-tenant summary)."""
    load0 = os.getloadavg()
    clients = {t: EditClient(topo.url, api_key=k, timeout_s=CLIENT_TIMEOUT_S) for t, k in keys.items()}
    try:
        recs, wall = runner.run(clients[LIGHT[0]], reqs, runner.Assets(256), timeout_s=drain_s(), progress=False,
                                clients=clients)
    finally:
        for c in clients.values():
            c.close()
    by = {}
    for tenant in sorted({r.tenant for r in reqs}):
        mine = [rec for rec, r in zip(recs, reqs) if r.tenant == tenant]
        by[tenant] = tenant_summary(mine, wall)
        if tenant == FLOOD:
            del by[tenant]["latencies_s"]  # hundreds; its P95 is enough
    light = [rec for rec, r in zip(recs, reqs) if r.tenant in LIGHT]
    by["light (all)"] = tenant_summary(light, wall)
    out = {"wall_s": round(wall, 1), "loadavg_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
           "tenants": by}
    print(f"{name}: " + json.dumps({t: {k: s[k] for k in ("sent", "ok", "refused", "lost", "p95_s")}
                                    for t, s in by.items()}), flush=True)
    return recs, out


def tenant_summary(recs: list, wall_s: float) -> dict:
    s = records.summarize(recs, wall_s)
    refused = s["errors"].get("RESOURCE_EXHAUSTED", 0)
    other = {k: v for k, v in s["errors"].items() if k not in ("RESOURCE_EXHAUSTED", runner.LOST)}
    by: dict[str, int] = {}
    for r in recs:
        if r.error_code == "RESOURCE_EXHAUSTED":
            by[refused_by(r.error)] = by.get(refused_by(r.error), 0) + 1
    return {"sent": len(recs), "ok": s["completed"], "refused": refused, "refused_by": by, "other_errors": other,
            "lost": s["lost"],
            "p50_s": _r(s["p50_s"]), "p95_s": _r(s["p95_s"]),
            "latencies_s": [round(r.latency_s, 3) for r in recs if r.latency_s is not None]}


def refused_by(message: str) -> str:
    """Who refused: the router's fair queue, a backend giving a place to a lighter tenant, or as
    ``overload.refusal_source`` tells (the router's admission or in-flight limits, a backend's check)."""
    if "fair queue" in (message or ""):
        return "router_fair_queue"
    if "fair share" in (message or ""):
        return "backend_displaced"
    return refusal_source(message)


def _r(x):
    return None if x is None else round(x, 3)


def settled_leftovers(topo, wait_s: float = 20.0) -> dict:
    """What the stopped parts left behind, once their processes had ``wait_s`` to exit (a loaded host is slow)."""
    deadline = time.monotonic() + wait_s
    while any((left := topo.leftovers()).values()) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def rows_of(result: dict, device: str, dtype: str) -> list[dict]:
    """One row per tenant and set-up; ``p95_alone_s`` from the one phase without the flood (measured once: with
    the light tenants alone the queues hold a request or two, and fair share has nothing to reorder)."""
    rows = []
    alone = result["phases"].get("alone")
    for layers, fair in (("router+backend", True), ("backend", True), ("off", False)):
        run = result["phases"].get(layers)
        if run is None or alone is None:
            continue
        for tenant, s in run["tenants"].items():
            a = alone["tenants"].get(tenant, {}).get("p95_s")
            rows.append({"tenant": tenant, "fair_share": fair, "layers": layers, "p95_s": s["p95_s"],
                         "p95_alone_s": a, "ratio": _r(s["p95_s"] / a) if a and s["p95_s"] else None,
                         "sent": s["sent"], "ok": s["ok"], "refused": s["refused"], "other_errors": s["other_errors"],
                         "lost": s["lost"], "loadavg_1m": run["loadavg_1m"], "device": device, "dtype": dtype})
    return rows


def targets(rows: list[dict], limit: float = 1.5) -> dict:
    """With fair share in the router and the backends: every light tenant's P95 within ``limit`` x its P95 alone
    (each tenant, not only their pool), and no request lost in any set-up."""
    fair = [r for r in rows if r["layers"] == "router+backend" and r["tenant"] in LIGHT]
    pooled = next((r for r in rows if r["layers"] == "router+backend" and r["tenant"] == "light (all)"), {})
    return {"each_light_tenant_p95_within_1.5x_alone": bool(fair) and all(r["ratio"] is not None and
                                                                          r["ratio"] <= limit for r in fair),
            "worst_light_tenant_ratio": max((r["ratio"] for r in fair if r["ratio"] is not None), default=None),
            "light_p95_within_1.5x_alone_with_fair_share": pooled.get("ratio") is not None and pooled["ratio"] <= limit,
            "light_requests_per_tenant": min((r["sent"] for r in fair), default=0),
            "nothing_lost": all(r["lost"] == 0 for r in rows)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    tenants = [*LIGHT, "light (all)"]
    shown = [(k, result["phases"][k]) for k in ("alone", "router+backend", "backend", "off")
             if k in result["phases"]]
    w = 0.8 / max(1, len(shown))
    for i, (name, ph) in enumerate(shown):
        vals = [ph["tenants"].get(t, {}).get("p95_s") or 0 for t in tenants]
        axes[0].bar(np.arange(len(tenants)) + i * w, vals, w, label=name)
    axes[0].set_xticks(np.arange(len(tenants)) + w * (len(shown) - 1) / 2, tenants)
    axes[0].set(ylabel="P95 latency (s)", title="light tenants' P95: alone, with the flood (fair share on / off)")
    axes[0].legend(fontsize=8)
    for name, ph in shown:
        lat = np.sort(ph["tenants"]["light (all)"]["latencies_s"])
        if len(lat):
            axes[1].plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=name)
    axes[1].set(xlabel="latency (s)", ylabel="fraction of light requests served", title="light tenants' latency CDF")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"flood at 3x capacity ({result['capacity_rps']:.2f} req/s), four tenants at 10 % each; "
                 f"{result['host']['cpus']} CPU cores, load avg {result['host']['loadavg_1m_start']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--probe-rate", type=float, default=12.0, help="load used to measure capacity (well past it)")
    ap.add_argument("--probe-s", type=float, default=15.0)
    ap.add_argument("--light-requests", type=int, default=30, help="requests each light tenant sends per phase "
                    "(its P95 alone and with the flood rest on these): a phase sends for this many / (10 %% of "
                    "capacity) seconds")
    ap.add_argument("--duration", type=float, default=None, help="seconds of sending per phase (instead of "
                    "--light-requests)")
    ap.add_argument("--steps", type=int, default=16, help="denoising steps per request")
    ap.add_argument("--max-batch", type=int, default=4, help="MASKEDIT_MAX_BATCH")
    ap.add_argument("--fair-slots", type=int, default=2, help="the router's --fair-share-slots: edits let into a "
                    "backend at once (fewer: a light tenant's request waits behind fewer of the flood's at each of "
                    "the backend's first-come stages, and the flood gets less of the backend)")
    ap.add_argument("--max-queue", type=int, default=8, help="each server's denoise queue (MASKEDIT_MAX_QUEUE)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "tenants")
    ap.add_argument("--result", type=Path, default=RESULTS / "tenants.json")
    args = ap.parse_args(argv)
    keys = workload.tenant_keys([*LIGHT, FLOOD], seed=27)
    args.out.mkdir(parents=True, exist_ok=True)
    key_file = args.out / "keys.txt"
    workload.write_key_file(key_file, keys)
    keyed = ["--api-keys-file", str(key_file)]
    # One denoise thread: on a shared 2-core host a 2-thread OpenMP team waits at every barrier for a core another
    # process holds (measured: a matmul loop 5-6x slower with 2 threads than with 1 at load average 14).
    env = {"MASKEDIT_MAX_QUEUE": str(args.max_queue), "MASKEDIT_MAX_BATCH": str(args.max_batch),
           "MASKEDIT_THREADS_MASKED_DENOISE": "1"}
    started = time.time()
    result = {"command": "python -m maskedit_lab.reliability.tenant_fairness "
                         + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "steps": args.steps,
              "max_batch": args.max_batch, "max_queue": args.max_queue, "fair_slots": args.fair_slots, "instances": args.instances,
              "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_1m_start": round(os.getloadavg()[0], 2),
                       "note": "shared host: other work ran beside this one (see each phase's loadavg_1m)"},
              "phases": {}}
    # the backends share their queues by tenant; the router first without its queue (capacity, alone, a flood
    # that gets past the router), then with it (fair share in both)
    with running_topology(args.instances, args.out / "fair", {**env, "MASKEDIT_FAIR_SHARE": "1"}, keyed) as topo:
        settings = topo.servers[0].settings
        device, dtype = settings.torch_device, settings.dtype
        print(f"capacity: {args.probe_rate:g} req/s offered for {args.probe_s:g} s", flush=True)
        _, s = capacity.run_at(topo.url, args.probe_rate, args.probe_s, steps=args.steps, seed=1,
                               api_key=keys[FLOOD])
        cap = result["capacity_rps"] = round(capacity.capacity([s]), 3)
        if cap <= 0:
            raise SystemExit(f"the capacity probe completed no request ({s['errors']}); see {args.out}")
        duration = args.duration or args.light_requests / (LIGHT_SHARE * cap)
        result["duration_s"] = round(duration, 1)
        # four phases of sending, each drained (up to a minute), and the second topology's start
        print(f"capacity {cap:.2f} req/s: flood {FLOOD_SHARE * cap:.2f} req/s, light tenants {LIGHT_SHARE * cap:.2f} "
              f"req/s each, {duration:.0f} s a phase: about {(4 * (duration + 30) + 90) / 60:.0f} minutes left",
              flush=True)
        _, result["phases"]["alone"] = phase(topo, keys, mix(cap, duration, args.steps, False), "alone")
        flood = mix(cap, duration, args.steps, True)
        _, result["phases"]["backend"] = phase(topo, keys, flood, "backend")
        topo.stop_router()
        # on top of the arguments the topology started it with: they carry the backend key, without which every
        # backend refuses the router (one run's fair phase: the backend unhealthy, all 1 020 requests refused)
        topo.router_args = [*topo.router_args, "--fair-share-slots", str(args.fair_slots)]
        topo.start_router()
        _, result["phases"]["router+backend"] = phase(topo, keys, flood, "router+backend")
        topo.remember()
    leftovers = [settled_leftovers(topo)]
    with running_topology(args.instances, args.out / "off", {**env, "MASKEDIT_FAIR_SHARE": "0"}, keyed) as topo:
        _, result["phases"]["off"] = phase(topo, keys, flood, "off")
        topo.remember()
    leftovers.append(settled_leftovers(topo))
    result["leftovers_after_shutdown"] = leftovers
    result["host"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.time() - started, 1)
    result["rows"] = rows_of(result, device, dtype)
    result["target"] = targets(result["rows"])
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1))
    plot(result, args.result.with_suffix(".png"))
    print(json.dumps([{k: r[k] for k in ("tenant", "layers", "p95_s", "p95_alone_s", "ratio", "sent", "refused",
                                         "lost")} for r in result["rows"]], indent=0))
    print(f"wrote {args.result} and {args.result.with_suffix('.png')}; target: {result['target']}")


if __name__ == "__main__":
    main()
