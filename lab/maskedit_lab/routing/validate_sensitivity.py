"""`make router-sensitivity` (`python -m maskedit_lab.routing.validate_sensitivity --from FILE`): how far each
measured run's simulated P95 moves with the host's speed, beside what the run measured.

The validation replays a run with the host's speed from the calibrations either side of it. Near saturation a
queue's tail is steep in the service time, so a small error in that speed is a large error in P95. This replays
every run of a ``router-validate`` file with its host slowed by each factor (``HostModel.slowdown``: every CPU task
of both instances, pre/post-processing and writes included), and with noise on every task instead (lognormal, mean
1, ``--noise-cv``, several seeds: whether chance alone tips a run). Per run it reports the slowdown at which the
replay meets the measured P95, the P95's elasticity at the calibrated speed (% of P95 per % of speed), and what
the host did during the run: its denoise loops' CPU per thousand token-steps computed (``HostSampler``), against
the file's median run. Beside them, the spread of the file's calibrations (hit and template-run speed ratios).
``run_speed``: the run replayed at the speed its own record gives (the slowdown whose replay gives the denoise loops
the CPU the run's used: a measure of the run's work and speed, not of its waits), its P95 and mean against the
measured; ``run_speed_host_load`` the same with the CPU spent outside the instances added. ``ranking``: the
validation's ranking check (``validate_replay.ranking``) for the replays at the calibrated speed and at each run's
own.
Replays only: seconds, no cluster. Writes JSON and a plot (P95 against slowdown, one panel per load).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from .validate_replay import _err, _p95, _scaling, block_bootstrap_ci, calibrations, headline_replay, ranking

FACTORS = (0.9, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.4)
NOISE_CVS = (0.2, 0.5)
DENOISE = "masked_denoise"  # the denoise loop's process, as ``HostSampler.by_model`` names it


def denoise_cpu_s(run_: dict) -> float | None:
    """The CPU seconds the run's denoise processes used over it (its ``HostSampler`` record; None without one)."""
    samples = run_.get("host") or []
    if not any(DENOISE in s.get("by_model", {}) for s in samples):  # none, or recorded before ``by_model``
        return None
    t = [s["t"] for s in samples]
    dts = np.diff([t[0] - 1.0] + t)  # a sample covers the interval since the one before (the first: a second)
    return float(sum(s["by_model"].get(DENOISE, 0.0) * dt for s, dt in zip(samples, dts)))  # cores x seconds


def denoise_cpu_per_ktoken_step(meta: dict, run_: dict) -> float | None:
    """The run's denoise CPU (ms) per thousand token-steps its answered requests computed (a hit its computed
    tokens, a template run all of them): how much CPU the same work took over this run. None without a host
    record."""
    cpu_s = denoise_cpu_s(run_)
    if cpu_s is None:
        return None
    token_steps = sum((r["computed_tokens"] if r.get("cache_hit") and r.get("computed_tokens") is not None
                       else r["tokens"]) * meta["steps"] for r in run_["requests"] if r["error"] is None)
    return 1e6 * cpu_s / token_steps if token_steps else None


def matching_slowdown(factors, p95s, measured: float) -> float | None:
    """The slowdown at which the replay's P95 meets ``measured``: linear between the first two factors that bracket
    it (None when no two do)."""
    for (f0, p0), (f1, p1) in zip(zip(factors, p95s), list(zip(factors, p95s))[1:]):
        if min(p0, p1) <= measured <= max(p0, p1) and p0 != p1:
            return round(f0 + (f1 - f0) * (measured - p0) / (p1 - p0), 3)
    return None


def run_speed(measured: dict, i: int, host_load: bool = False, lo: float = 0.6, hi: float = 2.0,
              iters: int = 14) -> float | None:
    """The host's speed over run ``i`` from what the run measured of it, not of its latency: the slowdown at which
    the replay's denoise loops (steps and entry writes, which run in the denoise process) are given the CPU the
    run's denoise processes used (``denoise_cpu_s``). Waiting for a core costs no CPU, so this counts work and the
    speed it ran at (interference included), not queueing. ``host_load``: the replay with the CPU spent outside the
    instances (``headline_replay``). Bisection over [lo, hi]; None without a host record or outside the range."""
    target = denoise_cpu_s(measured["runs"][i])
    if target is None:
        return None

    def given_s(slowdown: float) -> float:
        cpu = headline_replay(measured, i, host_load, slowdown=slowdown)[1]
        return (cpu.get("denoise", 0.0) + cpu.get("write", 0.0)) / 1000

    if not given_s(lo) <= target <= given_s(hi):
        return None
    for _ in range(iters):  # the CPU given grows with the slowdown
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if given_s(mid) < target else (lo, mid)
    return round((lo + hi) / 2, 3)


def _spread(values: list[float]) -> dict:
    return {"min": round(min(values), 3), "max": round(max(values), 3), "max_over_min": round(max(values) / min(values), 3)}


def sensitivity(measured: dict, factors=FACTORS, noise_cvs=NOISE_CVS, seeds: int = 8) -> dict:
    meta, runs = measured["meta"], measured["runs"]
    factors = sorted(factors)
    scaled = _scaling(measured)[2]
    calibs = [scaled(c) for c in calibrations(measured)]
    speeds = [denoise_cpu_per_ktoken_step(meta, r) for r in runs]
    known = [s for s in speeds if s is not None]
    median_speed = statistics.median(known) if known else None
    rows, ranked = [], []  # ranked: ``ranking``'s rows, measured (with its bootstrap interval) and replayed
    for i, run_ in enumerate(runs):
        ok = sorted((r for r in run_["requests"] if r["error"] is None and r["latency_s"] is not None),
                    key=lambda r: r["t"])
        lat = np.array([r["latency_s"] for r in ok])
        p95 = {f: float(np.percentile(headline_replay(measured, i, slowdown=f)[0], 95)) for f in factors}
        noise = {}
        for cv in noise_cvs:
            got = [float(np.percentile(headline_replay(measured, i, noise_cv=cv, noise_seed=k)[0], 95))
                   for k in range(seeds)]
            noise[str(cv)] = {"min": round(min(got), 3), "median": round(statistics.median(got), 3),
                              "max": round(max(got), 3)}
        row = {"policy": run_.get("policy", meta["policy"]), "load": run_["load"],
               "measured_p95_s": round(float(np.percentile(lat, 95)), 3), "measured_mean_s": round(float(lat.mean()), 3),
               "simulated_p95_s": {str(f): round(v, 3) for f, v in p95.items()},
               "matching_slowdown": matching_slowdown(factors, [p95[f] for f in factors],
                                                      float(np.percentile(lat, 95))),
               "noise_p95_s": noise, "noise_seeds": seeds}
        if 1.0 in p95 and 1.05 in p95:  # % of P95 per % of speed, at the calibrated speed
            row["p95_elasticity"] = round((p95[1.05] / p95[1.0] - 1) / 0.05, 2)
        if speeds[i] is not None:
            row["denoise_cpu_ms_per_ktoken_step"] = round(speeds[i], 1)
            row["denoise_cpu_vs_file_median"] = round(speeds[i] / median_speed, 3)
        for name, host_load in (("run_speed", False), ("run_speed_host_load", True)):
            speed = run_speed(measured, i, host_load)
            if speed is not None:  # the replay at the run's own speed: its P95 and mean against the measured
                sim = headline_replay(measured, i, host_load, slowdown=speed)[0]
                row[name] = {"slowdown": speed, "p95_s": round(float(np.percentile(sim, 95)), 3),
                             "p95_error": _err(np.percentile(sim, 95), float(np.percentile(lat, 95))),
                             "mean_s": round(float(sim.mean()), 3), "mean_error": _err(sim.mean(), float(lat.mean()))}
        rows.append(row)
        at = {"policy": row["policy"], "load": row["load"]}
        ranked += [{**at, "model": "measured", "p95_s": row["measured_p95_s"], "p95_ci": block_bootstrap_ci(lat, _p95)},
                   {**at, "model": "calibrated", "p95_s": p95.get(1.0)}]
        if "run_speed" in row:
            ranked.append({**at, "model": "run_speed", "p95_s": row["run_speed"]["p95_s"]})
    return {"ranking": [*ranking(ranked, "calibrated"), *ranking(ranked, "run_speed")], "meta": {"source_meta": {k: meta.get(k) for k in ("model", "instances", "steps", "requests_per_load",
                                                               "host_cores", "policies", "calibrate_every")},
                     "factors": factors, "noise_cvs": list(noise_cvs), "model": "shared_cpu_bracketed",
                     "calibrations": {"count": len(calibs), "hit_scale": _spread([c["hit_scale"] for c in calibs]),
                                      "miss_scale": _spread([c["miss_scale"] for c in calibs])}},
            "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(loads), figsize=(max(6.0, 4.2 * len(loads)), 3.8), squeeze=False)
    for ax, load in zip(axes[0], loads):
        for r in (x for x in result["rows"] if x["load"] == load):
            f = [float(x) for x in r["simulated_p95_s"]]
            line, = ax.plot(f, list(r["simulated_p95_s"].values()), marker="o", ms=3,
                            label=f"{r['policy']} (measured {r['measured_p95_s']:.1f} s)")
            ax.axhline(r["measured_p95_s"], color=line.get_color(), ls="--", lw=0.8)
            if "run_speed" in r:  # the replay at the run's own speed
                ax.plot([r["run_speed"]["slowdown"]], [r["run_speed"]["p95_s"]], marker="*", ms=11,
                        color=line.get_color(), mec="black", mew=0.5)
        ax.set_title(f"load {load}")
        ax.set_xlabel("host slowdown (x calibrated)")
        ax.set_ylabel("simulated P95 (s)")
        ax.legend(fontsize=6)
    fig.suptitle("replayed P95 against the host's speed\ndashed: measured; star: replayed at the run's own speed",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", type=Path, required=True, help="a router-validate result file")
    ap.add_argument("--factors", type=float, nargs="*", default=list(FACTORS))
    ap.add_argument("--noise-cv", type=float, nargs="*", default=list(NOISE_CVS))
    ap.add_argument("--seeds", type=int, default=8, help="noise seeds per run and coefficient of variation")
    ap.add_argument("--out", type=Path, help="default: the source's name with _sensitivity")
    a = ap.parse_args(argv)
    out = a.out or a.source.with_name(a.source.stem + "_sensitivity.json")
    result = sensitivity(json.loads(a.source.read_text()), a.factors, a.noise_cv, a.seeds)
    result["meta"]["source"] = a.source.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for r in result["rows"]:
        print(json.dumps({k: r.get(k) for k in ("policy", "load", "measured_p95_s", "matching_slowdown",
                                                 "p95_elasticity", "denoise_cpu_vs_file_median", "run_speed")}))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
