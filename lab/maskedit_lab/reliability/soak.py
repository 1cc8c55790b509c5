"""`python -m maskedit_lab.reliability.soak` (`make soak`): a long open-loop run at the knee rate through the router,
with template churn past the activation store's memory budget, watching memory.

    python -m maskedit_lab.reliability.soak                       # 30 min after a short sweep for the knee;
                                                                  # JSON + plot in perf_profiles/results
    python -m maskedit_lab.reliability.soak --minutes 3 --rate 2  # a quick check at a given rate

Reports every process's resident memory (each Triton server's processes, the router), the bytes this system
holds in /dev/shm (activation-store memory tiers, Python-backend regions), the disk tier, latency and errors per
5-minute window, and the slope of memory after the first window (flat: within ``--flat-mb`` per 10 minutes).
A process's memory is judged without the pages of the store entries it has mapped (read from /proc/<pid>/smaps):
those are the store's files, counted in RSS once touched; they are reported and checked against what a process
may hold mapped at once. Nothing may be lost (no result and no error).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from loadgen import runner, workload
from maskedit.cache.store import MAPPED_CAP, SUFFIX
from maskedit.settings import REPO_ROOT
from maskedit_client import EditClient

from . import capacity, footprint
from .topology import Topology, running_topology

RESULTS = REPO_ROOT / "perf_profiles" / "results"


def shm_bytes(topo: Topology) -> dict[str, int]:
    """Bytes this system holds in /dev/shm: each instance's store memory tier and its Python-backend regions."""
    out = {}
    for i, s in enumerate(topo.servers):
        out[f"server{i}/store"] = footprint.dir_bytes(s.settings.cache.mem_dir)
        regions = (footprint.SHM / r for r in footprint.shm_regions(s.shm_prefix))
        out[f"server{i}/backend_regions"] = sum(p.stat().st_size for p in regions if p.exists())
    return out


def store_dirs(topo: Topology) -> list[Path]:
    return [d for s in topo.servers for d in (s.settings.cache.mem_dir, s.settings.cache.disk_dir)]


def sample(topo: Topology, t0: float) -> dict:
    pgids = topo.pgids()
    return {"t_s": round(time.perf_counter() - t0, 1), "rss": footprint.rss_by_process(pgids),
            "store_rss": footprint.store_rss_by_process(pgids, store_dirs(topo)),
            "shm": shm_bytes(topo),
            "disk": {f"server{i}": footprint.dir_bytes(s.settings.cache.disk_dir)
                     for i, s in enumerate(topo.servers)},
            "restarts": sum(i.total_restarts for i in topo.supervisor.instances)}


def slope_mb_per_10min(samples: list[dict], key, after_s: float) -> float | None:
    """Least-squares slope of one memory series (MB per 10 minutes) over the samples after ``after_s``."""
    pts = [(s["t_s"], key(s)) for s in samples if s["t_s"] >= after_s and key(s) is not None]
    if len(pts) < 3:
        return None
    t, v = np.array(pts, float).T
    return round(float(np.polyfit(t, v / 2**20, 1)[0] * 600), 2)


def _own(x: dict, name: str) -> int | None:
    """A process's resident memory outside the store entries it has mapped."""
    rss = x["rss"].get(name)
    return None if rss is None else rss - x.get("store_rss", {}).get(name, 0)


def store_mapped_check(samples: list[dict], entry_bytes: int, batching) -> dict:
    """The mapped store pages of each process, against what one process may hold mapped at once: the entries it
    keeps for reuse plus one per request in its batch or queue (each holds the entry its cache decision opened)."""
    entries = MAPPED_CAP + batching.max_batch + batching.max_queue
    peak = {n: max(x.get("store_rss", {}).get(n, 0) for x in samples) for n in {k for x in samples for k in x["rss"]}}
    bound = entries * entry_bytes
    return {"peak_mb": {n: round(v / 2**20, 1) for n, v in sorted(peak.items()) if v},
            "bound_mb": round(bound / 2**20, 1), "bound_entries": entries,
            "largest_entry_mb": round(entry_bytes / 2**20, 2),
            "within_bound": all(v <= bound for v in peak.values())}


def windows(recs, window_s: float) -> list[dict]:
    out = []
    end = max((r.submit_s for r in recs), default=0.0)
    for k in range(int(end // window_s) + 1):
        sel = [r for r in recs if k * window_s <= r.submit_s < (k + 1) * window_s]
        lat = [r.latency_s for r in sel if r.latency_s is not None]
        errs: dict[str, int] = {}
        for r in sel:
            if r.error:
                errs[r.error_code] = errs.get(r.error_code, 0) + 1
        hits = [r.cache_hit for r in sel if r.cache_hit is not None]
        out.append({"window": f"{k * window_s / 60:g}-{(k + 1) * window_s / 60:g} min", "sent": len(sel),
                    "ok": len(lat), "errors": errs,
                    "p50_s": round(float(np.percentile(lat, 50)), 3) if lat else None,
                    "p95_s": round(float(np.percentile(lat, 95)), 3) if lat else None,
                    "hit_rate": round(float(np.mean(hits)), 3) if hits else None})
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = np.array([x["t_s"] for x in s]) / 60
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for name in sorted({k for x in s for k in x["rss"]}):
        line, = axes[0].plot(t, [(_own(x, name) or np.nan) / 2**20 for x in s], label=name)
        if any(x.get("store_rss", {}).get(name) for x in s):
            axes[0].plot(t, [x["rss"].get(name, np.nan) / 2**20 for x in s], ls=":", color=line.get_color(),
                         label=f"{name} incl. mapped store entries")
    axes[0].set(xlabel="minutes", ylabel="MiB", title="resident memory per process, outside mapped store entries")
    axes[0].legend(fontsize=6)
    axes[1].plot(t, [sum(x["shm"].values()) / 2**20 for x in s], label="/dev/shm (stores + backend regions)")
    axes[1].plot(t, [sum(x["disk"].values()) / 2**20 for x in s], label="disk tier")
    axes[1].set(xlabel="minutes", ylabel="MiB", title="shared memory and disk tier")
    axes[1].legend(fontsize=7)
    w = result["windows"]
    x = np.arange(len(w))
    axes[2].plot(x, [v["p50_s"] for v in w], marker="o", label="P50")
    axes[2].plot(x, [v["p95_s"] for v in w], marker="o", label="P95")
    axes[2].set(xticks=x, xlabel="5-minute window", ylabel="latency (s)", title="latency per window")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"soak: {result['rate']} req/s through the router for {result['minutes']:g} min, "
                 f"{result['summary']['requests']} requests, {result['summary']['lost']} lost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, help="arrivals per second (default: the knee of a short sweep first)")
    ap.add_argument("--sweep", default="1,2,3,4,5,6", help="rates tried for the knee")
    ap.add_argument("--sweep-s", type=float, default=30.0)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--templates", type=int, default=2000, help="distinct templates (Zipf): churn past the budget")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--mem-mb", type=int, default=64, help="each instance's store memory budget")
    ap.add_argument("--disk-mb", type=int, default=1024, help="each instance's store disk budget")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=300.0)
    ap.add_argument("--flat-mb", type=float, default=5.0, help="largest memory slope (MB/10 min) called flat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "soak")
    ap.add_argument("--result", type=Path, default=RESULTS / "soak.json")
    ap.add_argument("--note", default="", help="recorded with the result (e.g. what else ran on the host)")
    args = ap.parse_args(argv)
    env = {"MASKEDIT_CACHE_MEM_BYTES": str(args.mem_mb << 20), "MASKEDIT_CACHE_DISK_BYTES": str(args.disk_mb << 20)}
    started = time.time()
    revision = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or None
    with running_topology(args.instances, args.out, env) as topo:
        sweep_rows = None
        rate = args.rate
        if rate is None:
            print("sweep for the knee:", flush=True)
            sweep_rows = capacity.sweep(topo.url, [float(r) for r in args.sweep.split(",")], args.sweep_s,
                                        templates=args.templates, zipf=args.zipf)
            rate = capacity.knee(sweep_rows)
        print(f"soak at {rate:g} req/s for {args.minutes:g} min", flush=True)
        reqs = workload.poisson(rate, int(rate * args.minutes * 60), n_templates=args.templates, zipf_s=args.zipf,
                                seed=args.seed)
        samples: list[dict] = []
        stop = threading.Event()
        t0 = time.perf_counter()

        def sampler():
            while True:
                samples.append(sample(topo, t0))
                if stop.wait(args.sample_s):
                    return

        th = threading.Thread(target=sampler, daemon=True, name="soak-sampler")
        th.start()
        with EditClient(topo.url) as client:
            recs, wall = runner.run(client, reqs, runner.Assets(256), timeout_s=120.0, progress=True)
        stop.set()
        th.join(30)
        samples.append(sample(topo, t0))
        end_entry_bytes = max((p.stat().st_size for d in store_dirs(topo) for p in Path(d).glob("*" + SUFFIX)),
                              default=0)
        topo.remember()
    leftovers = topo.leftovers()
    from loadgen.records import summarize

    summary = summarize(recs, wall)
    warm = args.window_s  # the first window warms caches and allocators: slopes are taken after it
    names = sorted({k for x in samples for k in x["rss"]})
    # What can leak is a process's memory outside the store entries it has mapped: those pages are file or
    # /dev/shm pages, counted in RSS once touched and bounded by how many entries a process may keep mapped.
    own = {n: slope_mb_per_10min(samples, lambda x, n=n: _own(x, n), warm) for n in names}
    slopes = {**own, "shm_total": slope_mb_per_10min(samples, lambda x: sum(x["shm"].values()), warm)}
    rss_slopes = {n: slope_mb_per_10min(samples, lambda x, n=n: x["rss"].get(n), warm) for n in names}
    flat = {k: v is not None and abs(v) <= args.flat_mb for k, v in slopes.items()}
    mapped = store_mapped_check(samples, end_entry_bytes, topo.servers[0].settings.batching)
    result = {
        "command": "python -m maskedit_lab.reliability.soak " + " ".join(argv if argv is not None
                                                                        else __import__("sys").argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "revision": revision,
        "minutes": args.minutes,
        "rate": rate, "knee_sweep": sweep_rows, "instances": args.instances, "templates": args.templates,
        "zipf": args.zipf, "mem_budget_mb": args.mem_mb, "disk_budget_mb": args.disk_mb,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "note": args.note},
        "summary": summary, "windows": windows(recs, args.window_s),
        "memory_slope_mb_per_10min": slopes, "flat": flat, "flat_limit_mb_per_10min": args.flat_mb,
        "rss_slope_mb_per_10min": rss_slopes, "store_mapped": mapped,
        "restarts": samples[-1]["restarts"] if samples else None, "leftovers_after_shutdown": leftovers,
        "met": {"nothing_lost": summary["lost"] == 0, "memory_flat": all(flat.values()),
                "store_mapped_bounded": mapped["within_bound"],
                "nothing_left": not any(leftovers.values())},
        "samples": samples,
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1))
    plot(result, args.result.with_suffix(".png"))
    tqdm.write(json.dumps({k: result[k] for k in ("rate", "summary", "memory_slope_mb_per_10min", "met")}))
    print(f"wrote {args.result} and {args.result.with_suffix('.png')}")


if __name__ == "__main__":
    main()
