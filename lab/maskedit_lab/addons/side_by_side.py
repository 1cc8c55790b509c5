"""Served against stock, side by side in one process: the case loop the in-process ControlNet benches share
(``bench_controlnet``, ``bench_controlnet_flux``), their rows and their plot.

Every case and both sides alternate within each round, so all see the same load on a shared machine; round 0 warms
up (loads the ControlNets, fills allocator pools) and is not timed. A row's headline (``served_s``/``stock_s``) is
the fastest run (the least disturbed on a shared machine, medians beside it) or the median, as each bench states."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

# one case's two sides, each called with the round number (its seed)
Sides = tuple[Callable[[int], object], Callable[[int], object]]


def alternate(cases: dict[str, Sides], reps: int) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds of each case's served and stock call over ``reps`` timed rounds after one warm-up round."""
    times = {case: ([], []) for case in cases}
    for i in range(reps + 1):
        for case, (served, stock) in cases.items():
            t0 = time.perf_counter()
            served(i)
            t1 = time.perf_counter()
            stock(i)
            t2 = time.perf_counter()
            if i:
                times[case][0].append(t1 - t0)
                times[case][1].append(t2 - t1)
    return times


def rows(times: dict[str, tuple[list[float], list[float]]], controls: dict[str, int], steps: int,
         headline: str = "fastest") -> list[dict]:
    """One row per case (``controls``: how many ControlNets each has; the first case is the base edit) with the
    ratios to the base edit and between the sides. ``headline="fastest"`` adds the medians as
    ``served_median_s``/``stock_median_s``; ``"median"`` reports the median as the headline."""
    if headline not in ("fastest", "median"):
        raise ValueError(f"headline must be 'fastest' or 'median', not {headline!r}")
    out = []
    for case, (served, stock) in times.items():
        r = {"case": case, "controls": controls[case]}
        if headline == "fastest":
            r.update(served_s=min(served), stock_s=min(stock), served_median_s=statistics.median(served),
                     stock_median_s=statistics.median(stock))
        else:
            r.update(served_s=statistics.median(served), stock_s=statistics.median(stock))
        r.update(served_runs=served, stock_runs=stock)
        out.append(r)
    base = out[0]
    for r in out:
        r["served_over_base"] = round(r["served_s"] / base["served_s"], 3)
        r["stock_over_served"] = round(r["stock_s"] / r["served_s"], 3)
        r["served_per_step_s"] = round(r["served_s"] / steps, 4)
    return out


def plot(rows: list[dict], path: Path, title: str, ylabel: str) -> None:
    """Served and stock seconds per case, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["served_s"] for r in rows], 0.4, label="served in-process (LocalEditor)")
    ax.bar(x + 0.2, [r["stock_s"] for r in rows], 0.4, label="stock Diffusers pipeline")
    ax.set_xticks(x, [r["case"] for r in rows])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
