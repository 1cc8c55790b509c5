"""``bench_addons``'s results: its rows made from the run's timings, FLOPs and merger stats, and written into
``addons.json`` (a partial run's rows replacing their old ones, other benchmarks' rows kept)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .report import merge_rows, relate, targets, with_baselines


def case_path(mode: str, st) -> str:
    """The adapter path a case took (its merge mode; under ``auto``, what the merger stats say it chose)."""
    if mode != "auto" or st is None:
        return {"never": "unmerged", "always": "merged"}.get(mode, "-")
    m, u = st["merged_calls"], st["unmerged_calls"]
    return "auto: merged" if m and not u else "auto: unmerged" if u and not m else "auto: both" if m else "-"


def merger_costs(m) -> dict | None:
    c = m.costs
    return None if c is None else {"delta_gflops": round(c.delta_flops / 1e9, 2), "merge_gflops":
                                   round(c.merge_flops / 1e9, 2), "layer_us": round(c.layer_s * 1e6, 1)}


def rows_from(times, flops, stats, paths, phases, around_s, device, dtype) -> list[dict]:
    med = {c: statistics.median(w for w, _ in v) for c, v in times.items() if v}
    cpu = {c: statistics.median(u for _, u in v) for c, v in times.items() if v}
    rows = []
    for c, v in times.items():
        fw = c.startswith("fw:")
        case = c[3:] if fw else c
        base = ("fw:base" if fw else "stock-base" if c == "naive" else "base-batch" if "batch" in c else "base")
        row = {"case": case, "preset": "flux-width (1 dual + 1 single block)" if fw else "bench",
               "device": device, "dtype": dtype, "latency_s": round(med[c], 4),
               "latencies_s": [round(t, 4) for t, _ in v], "cpu_s": round(cpu[c], 4),
               "baseline": base.removeprefix("fw:"),
               "overhead": round(med[c] / med[base] - 1, 4), "overhead_cpu": round(cpu[c] / cpu[base] - 1, 4),
               "flop_share": round(flops[c] / flops[base] - 1, 4),
               "requests": 4 if "batch" in c else 1}
        if "batch" in c:
            row["throughput_rps"], row["throughput_rps_cpu"] = round(4 / med[c], 3), round(4 / cpu[c], 3)
        if not fw and c not in ("naive", "stock-base") and "batch" not in c and "base" in med:
            row["e2e_overhead"] = round((med[c] - med["base"]) / (med["base"] + around_s), 4)
            row["e2e_overhead_cpu"] = round((cpu[c] - cpu["base"]) / (cpu["base"] + around_s), 4)
        st = stats.get(c)
        row["path"] = paths.get(c, "-")
        if st and st["merges"]:
            row["merge_s"] = round(st["merge_s"], 4)
        if c in phases:
            row["phases_s"] = {k: round(statistics.median(p[k] for p in phases[c]), 4) for k in phases[c][0]}
        rows.append(row)
    relate(rows)
    return rows


def write(out: Path, rows: list[dict], meta: dict, only: set | None) -> tuple[list[dict], dict]:
    """Write ``out`` and return the rows and meta it holds: ``only`` (a partial run, ``--cases``) replaces those
    cases' rows and records its meta under ``partial_runs``; a full run keeps other benchmarks' rows and meta."""
    if only is not None and out.exists():  # a partial run: its rows replace the old ones, its meta is recorded
        prev = json.loads(out.read_text())
        rows = merge_rows(prev["rows"], rows)
        part = {k: meta[k] for k in ("reps", "steps", "load_avg", "threads", "seconds", "merge_costs",
                                     "flux_width_merge_s")}
        part["cases"] = sorted(with_baselines(only))
        meta = prev["meta"]
        meta.setdefault("partial_runs", []).append(part)
        meta["targets_met"] = targets(rows)
    elif out.exists():  # a full run: other benchmarks' rows and meta in the file stay
        prev = json.loads(out.read_text())
        rows = rows + [r for r in prev["rows"] if "requests" not in r]
        meta.update({k: v for k, v in prev["meta"].items() if k not in meta and k != "partial_runs"})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows, meta
