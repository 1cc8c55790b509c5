"""`maskedit-router-sim`: scale the routing policies beyond this machine with a discrete-event simulation
(``sim_cluster``: simulated workers with step-level batching, two-tier stores and resident checkpoints, and
the real policy code in front of them).

Workload: a window of the GenTD26 production trace (``TraceWorkload``: its arrival pattern, steps, checkpoints and
LoRAs) with production-like mask ratios and Zipf-popular templates per checkpoint, at offered loads relative to the
cluster's capacity with compulsory misses only. Every policy side by side on the same workload; writes JSON rows and
a plot.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from maskedit_common.cost_model import CostModel
from maskedit_router.__main__ import default_profile
from maskedit_router.placement.features import EditFeatures
from maskedit_router.placement.policies import POLICIES, BackendLoad, Estimator

from .. import REPO_ROOT
from .sim_cluster import replay


@dataclass
class TraceWorkload:
    """A window of the GenTD26 production request log (``loadgen/traces``): arrival times (relative, seconds), steps,
    base checkpoint (``checkpoint_model_version_id``) and ``num_lora`` per request, replayed as edits with
    production-like mask ratios (InstGenIE's production workload: Beta, mean 0.11) and templates per checkpoint
    (an activation entry belongs to one template on one checkpoint), Zipf ``zipf_s`` over ``templates_per_model``.
    With ``lora_library`` > 0 each request's ``num_lora`` adapters are named, drawn as loadgen draws them (seeded
    Zipf over that many adapters, ``loadgen.workload.zipf_loras``): workers load each where it is not resident and
    the router tracks them; 0: unnamed, loaded with their checkpoint."""

    t: np.ndarray
    steps: list
    models: list
    loras: list
    ratios: np.ndarray
    templates: list
    adapters: list = field(default_factory=list)  # per request: its adapters' names (``lora_library`` > 0)

    @classmethod
    def load(cls, n: int = 4000, start: int = 10000, seed: int = 0, templates_per_model: int = 64,
             zipf_s: float = 1.1, workload: str = "production", path=None,
             lora_library: int = 0) -> "TraceWorkload":
        import csv
        import gzip
        from datetime import datetime

        from loadgen import workload as wl

        with gzip.open(path or wl.GENTD26, "rt", newline="") as fh:
            rows = list(csv.DictReader(fh))
        ts = [datetime.strptime(r["gmt_create"], "%Y-%m-%d %H:%M:%S").timestamp() for r in rows]
        order = np.argsort(ts, kind="stable")[start:start + n]
        rng = np.random.default_rng(seed)
        t = np.asarray([ts[i] for i in order]) + rng.random(len(order))  # second resolution: spread in the second
        t = np.sort(t - t.min())
        rows = [rows[i] for i in order]
        ratios = wl.mask_ratios(workload, len(rows), rng)
        tpl = wl.zipf_templates(len(rows), templates_per_model, zipf_s, rng)
        loras = [int(float(r["num_lora"] or 0)) for r in rows]
        names = wl.zipf_loras(loras, [f"lora-{i}" for i in range(lora_library)], zipf_s,
                              np.random.default_rng([seed, 29]))
        return cls(t, [max(1, int(float(r["num_inference_steps"] or 30))) for r in rows],
                   [r["checkpoint_model_version_id"] or "M?" for r in rows], loras, ratios,
                   [f"{r['checkpoint_model_version_id']}/t{k}" for r, k in zip(rows, tpl)],
                   [tuple(x[0] for x in n) for n in names])

    def features(self, est: Estimator, slo_scale: float, tokens: int = 1024) -> list[EditFeatures]:
        """Each request's features, its deadline ``slo_scale`` x its own cache-free service time alone."""
        out = []
        for i in range(len(self.t)):
            f = EditFeatures(self.templates[i], float(self.ratios[i]), tokens, self.steps[i], model=self.models[i],
                             loras=self.loras[i], adapters=self.adapters[i] if self.adapters else ())
            out.append(replace(f, deadline_s=slo_scale * est.request_ms(f, False) / 1000.0))
        return out

    def arrivals(self, rate: float, window: int = 200) -> np.ndarray:
        """The trace's arrival pattern at a mean of ``rate`` requests a second. The window spans days: compressed
        as it is, its diurnal swing (the busiest hours at ~4x the mean) becomes minutes of overload at any mean load.
        So the trend is taken out first (each gap divided by the mean gap of the ``window`` requests around it: the
        time-rescaling of a non-homogeneous process) and the trace's burstiness within that window is kept."""
        gaps = np.diff(self.t, prepend=self.t[0])
        gaps[0] = 0.0
        k = np.ones(window) / window
        pad = np.pad(gaps, (window // 2, window - window // 2 - 1), mode="edge")
        local = np.maximum(np.convolve(pad, k, mode="valid"), 1e-9)
        t = np.cumsum(gaps / local)
        return t * ((len(t) - 1) / t[-1]) / rate


def ideal_service_s(fs: list[EditFeatures], est: Estimator, step_fixed_ms: float = 2.0) -> float:
    """Mean service time (s) of ``fs`` with only compulsory misses: each template run once and each checkpoint
    loaded once in the whole cluster, every other request a memory-tier hit on a resident checkpoint. Its inverse
    per worker is the capacity the offered loads are fractions of: no policy can do better on average."""
    seen_t, seen_m, seen_a, total = set(), set(), set(), 0.0
    for f in fs:
        total += est.request_ms(f, f.template_key in seen_t) + step_fixed_ms * (f.steps or est.default_steps)
        if f.model is not None and f.model not in seen_m:
            total += est.model_ms(f, BackendLoad("cold"))
        total += sum(a not in seen_a for a in f.adapters) * est.lora_load_ms  # each adapter loaded once, too
        seen_t.add(f.template_key)
        seen_a.update(f.adapters)
        seen_m.add(f.model)
    return total / len(fs) / 1000.0


# One change each: the hot-spot guard back on, deadlines tested without a margin, the extra work not charged (greedy)
ABLATIONS = ({"abs_gate_ms": 2000.0}, {"deadline_margin": 1.0}, {"congestion_weight": 0.0, "min_work_weight": 0.0})


def simulate_trace(policy_name: str, workers: int, load: float, wl: TraceWorkload, est: Estimator,
                   slo_scale: float = 2.0, cache_templates: int = 16, disk_templates: int = 64, model_slots: int = 2,
                   max_batch: int = 4, step_fixed_ms: float = 2.0, predicted: dict | None = None) -> dict:
    """One cell: ``wl`` at ``load`` x the cluster's all-hit capacity on ``workers`` simulated workers.
    ``predicted``: settings of the ``predicted`` policy other than its defaults (an ablation)."""
    fs = wl.features(est, slo_scale)
    rate = load * workers / ideal_service_s(fs, est, step_fixed_ms)
    arrivals = list(zip(wl.arrivals(rate).tolist(), fs))
    out = replay(policy_name, workers, arrivals, est, max_batch=max_batch, step_fixed_ms=step_fixed_ms,
                 cache_templates=cache_templates, disk_templates=disk_templates, model_slots=model_slots,
                 policy_kw={"predicted": predicted} if predicted else None)
    lat = np.array([q.done - q.arrival for q in out["requests"]])
    ok = np.array([q.done - q.arrival <= q.f.deadline_s for q in out["requests"]])
    n = len(lat)
    label = policy_name + ("[" + ",".join(f"{k}={v:g}" for k, v in predicted.items()) + "]" if predicted else "")
    return {"policy": label, "workers": workers, "load": load, "rate": round(rate, 3),
            "p95_s": float(np.percentile(lat, 95)), "mean_s": float(lat.mean()),
            "p50_s": float(np.percentile(lat, 50)), "slo_attainment": float(ok.mean()),
            "decision_ms": out["decision_us_p50"] / 1000, "decision_ms_p99": out["decision_us_p99"] / 1000,
            "miss_rate": out["misses"] / n, "model_load_rate": out["model_loads"] / n,
            "disk_read_rate": out["disk_reads"] / n, "adapter_load_rate": out["adapter_loads"] / n, "requests": n,
            "simulated": True}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=32, help="workers of the load sweep")
    ap.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.7, 0.8, 0.9, 0.95],
                    help="offered load as a fraction of the cluster's capacity with compulsory misses only")
    ap.add_argument("--decision-workers", type=int, nargs="*", default=[8, 32, 128],
                    help="cluster sizes of the decision-time rows (at --decision-load)")
    ap.add_argument("--decision-load", type=float, default=0.8)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--trace-start", type=int, default=10000, help="first request of the trace window")
    ap.add_argument("--slo-scale", type=float, default=2.0, help="a request's deadline: this x its own cache-free "
                    "service time alone")
    ap.add_argument("--model-slots", type=int, default=2, help="base checkpoints resident per worker")
    ap.add_argument("--model-load-steps", type=float, default=3.0, help="loading a checkpoint that is not resident, "
                    "in full-model denoising steps at the profile's resolution (the load cost; see docs/router.md)")
    ap.add_argument("--lora-load-fraction", type=float, default=0.05, help="each LoRA's load, as a fraction of the "
                    "checkpoint's")
    ap.add_argument("--lora-library", type=int, default=0, help="name each request's num_lora adapters, drawn "
                    "(seeded Zipf) from this many; workers and the router track them (0: unnamed, loaded with "
                    "their checkpoint)")
    ap.add_argument("--ablations", action="store_true", help="also run the predicted policy with one of its rules "
                    "changed back at loads 0.8 and 0.95 (rows of kind 'ablation')")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "perf_profiles" / "results" / "router.json")
    args = ap.parse_args(argv)
    profile = default_profile()
    est = Estimator(CostModel.load_file(profile) if profile.exists() else CostModel.fallback())
    full_step_ms = est.request_ms(EditFeatures("x", 1.0, 1024, 1), False)
    est.model_load_ms = args.model_load_steps * full_step_ms
    est.lora_load_ms = args.lora_load_fraction * est.model_load_ms
    wl = TraceWorkload.load(args.requests, args.trace_start, lora_library=args.lora_library)
    kw = dict(slo_scale=args.slo_scale, model_slots=args.model_slots)
    rows = []

    def run(p, w, load, kind, predicted=None):
        t0 = time.perf_counter()
        row = dict(simulate_trace(p, w, load, wl, est, predicted=predicted, **kw), kind=kind)
        row["sim_wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)

    for load in args.loads:
        for p in args.policies:
            run(p, args.workers, load, "load_sweep")
    for w in args.decision_workers:
        if w == args.workers and args.decision_load in args.loads:
            continue
        for p in args.policies:
            run(p, w, args.decision_load, "decision_time")
    if args.ablations:  # the predicted policy with one of its rules changed back
        for load in (0.8, 0.95):
            for change in ABLATIONS:
                run("predicted", args.workers, load, "ablation", change)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    meta = {"profile": str(profile.name), "requests": args.requests,
            "workload": f"GenTD26 trace requests {args.trace_start}..{args.trace_start + args.requests} (all types; "
                        "arrival pattern compressed to the offered rate; steps, checkpoint_model_version_id, "
                        "num_lora replayed), production mask ratios (Beta mean 0.11), templates per checkpoint "
                        "Zipf 1.1 over 64",
            "capacity": "offered load is a fraction of the cluster's capacity with compulsory misses only (each "
                        "template run once and each checkpoint loaded once cluster-wide; router_sim.ideal_service_s)",
            "slo": f"deadline = {args.slo_scale} x the request's own cache-free service time alone",
            "store": {"mem_templates": 16, "disk_templates": 64, "disk_read_ms": round(est.tier_load_ms('disk'), 1),
                      "entry_bytes": est.entry_bytes},
            "checkpoints": {"slots_per_worker": args.model_slots, "load_ms": round(est.model_load_ms, 1),
                            "load_steps": args.model_load_steps, "lora_load_ms": round(est.lora_load_ms, 1)},
            "adapters": {"library": args.lora_library, "slots_per_worker": 32,
                         "note": "0: num_lora unnamed, loaded with the checkpoint; else named by loadgen's seeded "
                                 "Zipf draw over that many, each loaded where not resident"},
            "max_batch": 4, "policies": list(args.policies),
            "decision_ms": "median of the policy's choose() over every request of the run (this host's CPU)",
            "host": _host()}
    # router-validate's rows (``validation: true``) are kept: they were measured, this run only simulates
    doc = {"meta": meta, "rows": rows + [r for r in old.get("rows", []) if r.get("validation")]}
    if "validation" in old.get("meta", {}):
        meta["validation"] = old["meta"]["validation"]
    args.out.write_text(json.dumps(doc, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _host() -> dict:
    import os
    import platform

    return {"cpus": os.cpu_count(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "machine": platform.machine(), "python": platform.python_version(),
            "note": "shared 2-core development VM: decision times are noisy, other engineers' jobs ran alongside"}


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("validation") and r.get("kind") != "ablation"]
    sweep = [r for r in rows if r.get("kind") == "load_sweep"]
    dec = [r for r in rows if r.get("kind") in ("load_sweep", "decision_time")]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    w = sweep[0]["workers"] if sweep else 0
    for p in policies:
        rs = sorted([r for r in sweep if r["policy"] == p], key=lambda r: r["load"])
        style = dict(marker="o", lw=2.2 if p == "predicted" else 1.2)
        axes[0].plot([r["load"] for r in rs], [r["p95_s"] for r in rs], label=p, **style)
        axes[1].plot([r["load"] for r in rs], [r["slo_attainment"] for r in rs], label=p, **style)
        ds = {}
        for r in dec:
            if r["policy"] == p and (r["kind"] == "decision_time" or r["load"] == 0.8):
                ds[r["workers"]] = r["decision_ms"]
        ks = sorted(ds)
        axes[2].plot(ks, [ds[k] for k in ks], label=p, **style)
    axes[0].set(title=f"P95 latency, {w} simulated workers (GenTD26 trace)", xlabel="offered load (of capacity, "
                "compulsory misses only)", ylabel="P95 (s)", yscale="log")
    axes[1].set(title="SLO attainment", xlabel="offered load", ylabel="fraction within deadline", ylim=(0, 1.02))
    axes[2].set(title="decision time (median)", xlabel="workers", ylabel="ms", xscale="log", yscale="log")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
