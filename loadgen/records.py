"""Per-request records, summaries (mean/P50/P95/P99, throughput, goodput) and plots."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Record:
    index: int
    template: int
    mask_ratio: float
    arrival_s: float  # scheduled arrival
    submit_s: float  # when it was actually sent
    first_progress_s: float | None = None
    done_s: float | None = None
    queue_s: float | None = None
    denoise_s: float | None = None
    cache_hit: bool | None = None
    error: str | None = None
    error_code: str | None = None
    deadline_ms: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None or self.error else self.done_s - self.submit_s

    @property
    def answered_after_s(self) -> float | None:
        """Time from send to the final answer, result or error (None: no answer)."""
        return None if self.done_s is None else self.done_s - self.submit_s

    @property
    def on_time(self) -> bool:
        lat = self.latency_s
        return lat is not None and (self.deadline_ms is None or lat * 1000 <= self.deadline_ms)


def summarize(records: list[Record], wall_s: float) -> dict:
    lat = np.array([r.latency_s for r in records if r.latency_s is not None])
    ok = len(lat)
    q = lambda p: float(np.percentile(lat, p)) if ok else None  # noqa: E731
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error_code or "ERROR"] = errors.get(r.error_code or "ERROR", 0) + 1
    queue = [r.queue_s for r in records if r.queue_s is not None]
    hits = [r.cache_hit for r in records if r.cache_hit is not None]
    error_s: dict[str, float] = {}  # per code, the slowest error: a refusal must be fast
    for r in records:
        if r.error and r.answered_after_s is not None:
            error_s[r.error_code or "ERROR"] = max(error_s.get(r.error_code or "ERROR", 0.0), r.answered_after_s)
    return {
        "requests": len(records), "completed": ok, "errors": errors, "lost": errors.get("LOST", 0),
        "error_max_s": {k: round(v, 3) for k, v in error_s.items()},
        "mean_s": float(lat.mean()) if ok else None, "p50_s": q(50), "p95_s": q(95), "p99_s": q(99),
        "queue_mean_s": float(np.mean(queue)) if queue else None,
        "throughput": ok / wall_s if wall_s > 0 else None,
        "goodput": sum(r.on_time for r in records) / wall_s if wall_s > 0 else None,
        "cache_hit_rate": float(np.mean(hits)) if hits else None, "wall_s": wall_s,
    }


def write(records: list[Record], summary: dict, out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [dict(asdict(r), latency_s=r.latency_s) for r in records]
    (out_dir / f"{name}.json").write_text(json.dumps({"summary": summary, "records": rows}, indent=1))
    with open(out_dir / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "extra"] if rows else ["index"])
        w.writeheader()
        for row in rows:
            row.pop("extra", None)
            w.writerow(row)


def plot_runs(runs: dict[str, tuple[list[Record], dict]], path: Path, title: str = "") -> None:
    """Latency CDF per run, and P50/P95/P99 and goodput against offered rate when runs carry a rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, (recs, _) in runs.items():
        lat = np.sort([r.latency_s for r in recs if r.latency_s is not None])
        if len(lat):
            axes[0].plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=name)
    axes[0].set(xlabel="latency (s)", ylabel="fraction of requests", title="latency CDF")
    axes[0].legend(fontsize=7)
    by_mode: dict[str, list] = {}
    for name, (_, s) in runs.items():
        if s.get("rate") is not None:
            by_mode.setdefault(s.get("mode", name), []).append(s)
    for mode, ss in by_mode.items():
        ss.sort(key=lambda s: s["rate"])
        rates = [s["rate"] for s in ss]
        for p, style in (("p50_s", ":"), ("p95_s", "-"), ("p99_s", "--")):
            axes[1].plot(rates, [s[p] for s in ss], style, marker="o", label=f"{mode} {p[:3].upper()}")
        axes[2].plot(rates, [s["goodput"] for s in ss], marker="o", label=mode)
    axes[1].set(xlabel="offered rate (req/s)", ylabel="latency (s)", title="P50 / P95 / P99 vs rate")
    axes[1].legend(fontsize=7)
    axes[2].set(xlabel="offered rate (req/s)", ylabel="requests/s finished on time", title="goodput")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
