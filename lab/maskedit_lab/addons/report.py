"""The LoRA benchmark's report (``bench_addons``): the issue's targets checked on its rows, a plot and a table.

    python -m maskedit_lab.addons.report perf_profiles/results/addons.json   # plot and table again from the JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = {"warm_vs_flop_share": 1.5, "flux_width_warm_2": 0.05, "cold_host_e2e": 0.10, "mixed_vs_same": 0.9}


def targets(rows) -> dict:
    """Each target on wall-clock latency and on CPU time (``_cpu``), for the cases the rows hold (a partial run into a
    new file judges only what it measured)."""
    by = {r["case"] + ("@fw" if "flux" in r["preset"] else ""): r for r in rows}
    out = {}
    for k in ("", "_cpu"):
        for c in ("warm-1", "warm-2", "warm-1-merged", "warm-2-merged"):
            if c in by:
                out[f"{c} overhead{k} <= 1.5 x flop share"] = by[c][f"overhead{k}"] <= \
                    TARGETS["warm_vs_flop_share"] * max(by[c]["flop_share"], 0.0)
        for c in ("warm-2@fw", "warm-2-merged@fw"):
            if c in by:
                out[f"{c} overhead{k} <= 5%"] = by[c][f"overhead{k}"] <= TARGETS["flux_width_warm_2"]
        if "cold-host" in by:
            out[f"cold-host e2e_overhead{k} <= 10%"] = by["cold-host"][f"e2e_overhead{k}"] <= TARGETS["cold_host_e2e"]
        if "mixed-batch" in by:
            out[f"mixed-batch throughput{k} >= 0.9 x same-batch"] = \
                by["mixed-batch"][f"throughput_vs_same_batch{k}"] >= TARGETS["mixed_vs_same"]
    return out


def with_baselines(only: set) -> set:
    """The cases named and the ones their overheads are measured against."""
    out = set(only)
    for c in only:
        fw = c.startswith("fw:")
        out.add("fw:base" if fw else "stock-base" if c == "naive" else "base-batch" if "batch" in c else "base")
    return out


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` rows with those of the cases in ``new`` replaced (a partial run, ``--cases``), then the ratios between
    cases recomputed."""
    key = lambda r: (r["case"], r["preset"])  # noqa: E731
    fresh = {key(r): r for r in new}
    rows = [fresh.pop(key(r), r) for r in old] + list(fresh.values())
    relate(rows)
    return rows


def relate(rows: list[dict]) -> None:
    """Ratios between cases: the mixed and merged batches' throughput over the same-set batch's."""
    by = {r["case"] + ("@fw" if "flux" in r["preset"] else ""): r for r in rows}
    if "mixed-batch" in by and "same-batch" in by:
        for c in ("mixed-batch", "same-batch-merged"):
            if c not in by:
                continue
            for k in ("", "_cpu"):
                by[c][f"throughput_vs_same_batch{k}"] = round(by[c][f"throughput_rps{k}"] /
                                                              by["same-batch"][f"throughput_rps{k}"], 3)


def lora_rows(rows: list[dict]) -> list[dict]:
    """This benchmark's rows (other benchmarks' rows share the file: ``bench_controlnet_mask``)."""
    return [r for r in rows if "requests" in r]


def plot(rows: list[dict], path: Path, rank: int = 16, steps: int = 8) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = lora_rows(rows)
    groups = [(f"bench preset: one request ({steps} steps)", [r for r in rows if r["preset"] == "bench"
                                                        and r["requests"] == 1]),
              ("bench preset: 4 requests in one step batch", [r for r in rows if r["requests"] == 4]),
              ("FLUX.1 widths: dual + single block", [r for r in rows if r["preset"] != "bench"])]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5), gridspec_kw={"width_ratios": [10, 4, 3.2]})
    for ax, (title, rs) in zip(axes, groups):
        xs = range(len(rs))
        ax.bar([x - 0.27 for x in xs], [100 * r["overhead"] for r in rs], 0.27, label="overhead (wall clock)")
        ax.bar(list(xs), [100 * r["overhead_cpu"] for r in rs], 0.27, label="overhead (CPU time)")
        ax.bar([x + 0.27 for x in xs], [100 * r["flop_share"] for r in rs], 0.27, label="FLOP share")
        ax.set_xticks(list(xs), [r["case"] for r in rs], rotation=35, ha="right", fontsize=8)
        ax.set(title=title, ylabel="% over its baseline")
        ax.axhline(0, color="k", lw=0.5)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    r0 = rows[0]
    fig.suptitle(f"LoRA adapters (rank {rank}, attention + MLP): % over each case's baseline (base, base-batch, "
                 f"stock-base) — {r0['device']}, {r0['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| preset | case | latency s | CPU s | baseline | overhead | overhead (CPU) | FLOP share | e2e overhead "
             "(CPU) | path |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in lora_rows(rows):
        e2e = f"{r['e2e_overhead']:+.1%} ({r['e2e_overhead_cpu']:+.1%})" if "e2e_overhead" in r else "–"
        lines.append(f"| {r['preset']} | {r['case']} | {r['latency_s']:.3f} | {r['cpu_s']:.3f} | {r['baseline']} | "
                     f"{r['overhead']:+.1%} | {r['overhead_cpu']:+.1%} | {r['flop_share']:+.1%} | {e2e} | "
                     f"{r.get('path', '–')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    data = json.loads(path.read_text())
    plot(data["rows"], path.with_suffix(".png"), data["meta"]["rank"], data["meta"]["steps"])
    print(markdown_table(data["rows"]))
    print(json.dumps(targets(data["rows"]), indent=1))
