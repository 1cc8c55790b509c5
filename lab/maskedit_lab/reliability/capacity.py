"""Short open-loop runs at increasing rates: where latency bends (the knee) and what the system completes at
most (its capacity). Soak and overload runs pick their rates from these."""

from __future__ import annotations

from loadgen import records, runner, workload
from maskedit_client import EditClient


def run_at(url: str, rate: float, duration_s: float, templates: int = 8, zipf: float = 1.1, seed: int = 0,
           steps: int | None = None, progress: bool = False, api_key: str | None = None) -> tuple[list, dict]:
    reqs = workload.poisson(rate, max(1, int(rate * duration_s)), n_templates=templates, zipf_s=zipf, steps=steps,
                            seed=seed)
    with EditClient(url, api_key=api_key) as c:  # api_key: a router with keys on
        recs, wall = runner.run(c, reqs, runner.Assets(256), timeout_s=60.0, progress=progress)
    return recs, dict(records.summarize(recs, wall), rate=rate)


def sweep(url: str, rates: list[float], duration_s: float = 30.0, **kw) -> list[dict]:
    out = []
    for i, rate in enumerate(rates):
        _, s = run_at(url, rate, duration_s, seed=100 + i, **kw)
        out.append(s)
        print(f"  {rate:g} req/s: P50 {s['p50_s']:.3f} P95 {s['p95_s']:.3f}, throughput {s['throughput']:.2f}, "
              f"errors {s['errors']}", flush=True)
    return out


def knee(rows: list[dict], p50_factor: float = 2.0) -> float:
    """The highest rate up to which every rate is served in full (no errors, at least 90 % completed) with a
    median latency at most ``p50_factor`` times the lowest rate's: past it, queues grow. The median, not the
    P95: on a shared host one noisy run's P95 stopped the sweep early (1.8 s at 3 req/s, 0.63 s at 4, 3.9 s at 5)."""
    base = rows[0]["p50_s"] or 0.0
    best = rows[0]["rate"]
    for s in rows:
        served = not s["errors"] and s["completed"] >= 0.9 * s["requests"]
        if served and s["p50_s"] is not None and s["p50_s"] <= p50_factor * base:
            best = s["rate"]
        else:
            break
    return best


def capacity(rows: list[dict]) -> float:
    """Completed requests per second at the highest load offered (saturation throughput)."""
    return max(s["completed"] / s["wall_s"] for s in rows if s["wall_s"])
