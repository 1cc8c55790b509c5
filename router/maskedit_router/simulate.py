"""`maskedit-router-sim`: scale the routing policies beyond this machine with a discrete-event simulation.

N simulated workers each run step-level continuous batching (max batch 4): a step takes the sum of its requests'
per-step times from the measured cost-model profile (on this CPU a step's cost grows with the batch), a request
on a template the worker holds computes only its masked tokens (kv blocks), otherwise the full model, after which
the worker holds the template (LRU of ``cache_templates``). Workload: loadgen's Poisson arrivals, InstGenIE's
public mask-ratio distribution and Zipf-popular templates. The router side is the real policy code
(``policies.py``) with the router's own bookkeeping. Writes JSON rows and a plot.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from maskedit.cache.cost_model import CostModel
from maskedit.settings import REPO_ROOT

from .features import EditFeatures
from .policies import BackendLoad, Estimator, make

POLICIES = ("predicted", "round_robin", "least_requests", "least_masked_tokens")


@dataclass
class SimRequest:
    rid: int
    arrival: float
    f: EditFeatures
    steps_left: int = 0
    step_ms: float = 0.0
    done: float | None = None
    predicted_ms: float = 0.0


@dataclass
class Worker:
    load: BackendLoad
    cache: OrderedDict = field(default_factory=OrderedDict)
    cache_templates: int = 16
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    stepping: bool = False
    step_end: float = 0.0  # when the step in flight ends
    step_token: int = 0  # identifies the current step event (an extended step supersedes its old event)

    def holds(self, key) -> bool:
        return key in self.cache

    def touch(self, key) -> None:
        self.cache[key] = True
        self.cache.move_to_end(key)
        while len(self.cache) > self.cache_templates:
            self.cache.popitem(last=False)


def simulate(policy_name: str, workers: int, rate: float, n: int, est: Estimator, seed: int = 0,
             templates: int = 64, max_batch: int = 4, steps: int = 8, step_fixed_ms: float = 2.0) -> dict:
    """Poisson arrivals of the public workload at ``rate`` on ``workers`` simulated workers."""
    from loadgen import workload

    reqs = workload.poisson(rate, n, workload="public", n_templates=templates, zipf_s=1.1, seed=seed)
    arrivals = [(r.t, EditFeatures(f"t{r.template}", r.mask_ratio, 1024, steps)) for r in reqs]
    done = replay(policy_name, workers, arrivals, est, max_batch=max_batch, step_fixed_ms=step_fixed_ms)
    lat = np.array([q.done - q.arrival for q in done["requests"]])
    return {"policy": policy_name, "workers": workers, "rate": rate, "p50_s": float(np.percentile(lat, 50)),
            "p95_s": float(np.percentile(lat, 95)), "mean_s": float(lat.mean()), "simulated": True,
            "decision_us_p50": done["decision_us_p50"], "requests": n}


def replay(policy_name: str, workers: int, arrivals: list[tuple[float, EditFeatures]], est: Estimator,
           max_batch: int = 4, step_fixed_ms: float = 2.0, cache_templates: int = 16,
           service: Estimator | None = None, host_ms: float = 0.0) -> dict:
    """Run ``arrivals`` (time in seconds, features) through the policy and ``workers`` simulated workers.
    ``est`` is the router's estimator; ``service`` gives the workers' true service times (default: ``est``).
    ``host_ms``: CPU time a request spends outside denoising (decode, encode, PNG) on the same cores as the
    worker's denoise loop, as on a CPU-only host; it is charged to the worker's next step (0 on GPU hosts,
    where it runs on otherwise idle CPU cores). Half (pre-processing) lengthens the step in flight when the
    request arrives, half (post-processing) the next step after it leaves, if any; its own latency gets the
    host time added by the caller.
    Returns the finished ``SimRequest``s (``done`` is set, in arrival order) and the median routing decision."""
    service = service or est
    policy = make(policy_name, est)
    ws = [Worker(BackendLoad(f"w{i}"), cache_templates=cache_templates) for i in range(workers)]
    events: list = []  # (time, seq, kind, payload)
    seq = itertools.count()
    for i, (t, f) in enumerate(arrivals):
        heapq.heappush(events, (t, next(seq), "arrive", SimRequest(i, t, f)))
    finished: list[SimRequest] = []
    decision_s = []

    def start_step(w: Worker, now: float) -> None:
        while w.waiting and len(w.running) < max_batch:
            q = w.waiting.pop(0)
            cached = w.holds(q.f.template_key)
            q.steps_left = q.f.steps
            q.step_ms = service.request_ms(q.f, cached) / q.f.steps
            w.touch(q.f.template_key)  # recorded by its own run (miss) or refreshed (hit)
            w.running.append(q)
        if not w.running:
            w.stepping = False
            return
        w.stepping = True
        dur = (step_fixed_ms + sum(q.step_ms for q in w.running)) / 1000.0
        w.step_end, w.step_token = now + dur, w.step_token + 1
        heapq.heappush(events, (w.step_end, next(seq), "step", (w, w.step_token)))

    def charge_host(w: Worker) -> None:
        """Half a request's host work runs on this worker's cores during its step in flight."""
        if host_ms and w.stepping:
            w.step_end, w.step_token = w.step_end + host_ms / 2000.0, w.step_token + 1
            heapq.heappush(events, (w.step_end, next(seq), "step", (w, w.step_token)))

    while events:
        now, _, kind, obj = heapq.heappop(events)
        if kind == "arrive":
            t0 = time.perf_counter()
            w = ws[[x.load for x in ws].index(policy.choose([x.load for x in ws], obj.f))]
            decision_s.append(time.perf_counter() - t0)
            cached = w.load.holds(obj.f.template_key, now)
            obj.predicted_ms = est.request_ms(obj.f, cached)
            w.load.inflight += 1
            w.load.backlog_ms += obj.predicted_ms
            w.load.masked_tokens += int(obj.f.mask_ratio * obj.f.tokens)
            w.load.templates[obj.f.template_key] = now + 1e9  # router index: sim time never expires
            w.waiting.append(obj)
            if w.stepping:
                charge_host(w)  # its pre-processing slows the step in flight
            else:
                start_step(w, now)
        else:
            w, token = obj
            if token != w.step_token:
                continue  # superseded: the step was extended
            left = 0
            for q in list(w.running):
                q.steps_left -= 1
                if q.steps_left == 0:
                    w.running.remove(q)
                    q.done = now
                    finished.append(q)
                    w.load.inflight -= 1
                    w.load.backlog_ms = max(0.0, w.load.backlog_ms - q.predicted_ms)
                    w.load.masked_tokens -= int(q.f.mask_ratio * q.f.tokens)
                    left += 1
            start_step(w, now)
            for _ in range(left):
                charge_host(w)  # post-processing of those that left slows the next step
    return {"requests": sorted(finished, key=lambda q: q.rid),
            "decision_us_p50": float(np.percentile(decision_s, 50) * 1e6) if decision_s else 0.0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="*", default=[4, 8, 32])
    ap.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.7, 0.85, 0.95],
                    help="offered load as a fraction of the cluster's all-hit capacity")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "perf_profiles" / "results" / "router.json")
    args = ap.parse_args(argv)
    profile = REPO_ROOT / "perf_profiles" / "cost_model_bench-flux-fill.json"
    est = Estimator(CostModel.load_file(profile) if profile.exists() else CostModel.fallback())
    mean_hit_s = est.request_ms(EditFeatures("x", 0.19, 1024, 8), True) / 1000
    rows = []
    for w in args.workers:
        for load in args.loads:
            rate = round(load * w / mean_hit_s, 3)
            for p in POLICIES:
                row = dict(simulate(p, w, rate, args.requests, est), load=load)
                rows.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": {"profile": str(profile.name), "requests": args.requests,
                                             "workload": "public, Zipf 1.1 over 64 templates, 8 steps",
                                             "cache_templates_per_worker": 16, "max_batch": 4}, "rows": rows},
                                   indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({r["workers"] for r in rows})
    fig, axes = plt.subplots(1, len(workers), figsize=(5 * len(workers), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workers):
        for p in POLICIES:
            rs = sorted([r for r in rows if r["workers"] == w and r["policy"] == p], key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rs], [r["p95_s"] for r in rs], marker="o", label=p)
        ax.set(title=f"{w} workers (simulated)", xlabel="offered rate (req/s)", ylabel="P95 latency (s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
