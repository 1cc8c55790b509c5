"""`maskedit-router-sim`: scale the routing policies beyond this machine with a discrete-event simulation.

N simulated workers each run step-level continuous batching (max batch 4): a step takes the sum of its requests'
per-step times from the measured cost-model profile (on this CPU a step's cost grows with the batch), a request
on a template the worker holds computes only its masked tokens (kv blocks), otherwise the full model, after which
the worker holds the template (LRU of ``cache_templates``) from the start of that template run, as the engine lets
later requests follow a run in progress. Given each request's token mask, a worker also tracks which tokens of each
entry are invalid (the template run's own edit): a hit computes its mask and those, and heals them as the engine
does (a hit on a stored entry that leaves at least ``heal_min_ratio`` of the tokens' invalid ones unmasked makes
them valid when it completes). Optionally (``HostModel``) workers share CPU-only
hosts with their pre/post-processing, as on the machine the validation runs on. Workload: loadgen's Poisson
arrivals, InstGenIE's public mask-ratio distribution and Zipf-popular templates. The router side is the real policy code
(``maskedit_router.policies``) with the router's own bookkeeping. Writes JSON rows and a plot.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from maskedit_common.cost_model import CostModel
from maskedit_common.heal import HEAL_MIN_RATIO, after_heal, computed_tokens, heal_candidates, worth_healing
from maskedit_router.__main__ import default_profile
from maskedit_router.features import EditFeatures
from maskedit_router.policies import BackendLoad, Booking, Estimator, make

from . import REPO_ROOT

POLICIES = ("predicted", "round_robin", "least_requests", "least_masked_tokens")


@dataclass
class SimRequest:
    rid: int
    arrival: float
    f: EditFeatures
    steps_left: int = 0
    step_ms: float = 0.0
    started: float | None = None  # joined a running batch
    denoised: float | None = None  # left it
    done: float | None = None
    booking: Booking | None = None  # its entry in the router's account
    mask: np.ndarray | None = None  # its edited tokens (bool per image token), when known
    records: bool = False  # a template run: its entry is stored when it finishes
    heals: bool = False  # a hit that heals its entry's invalid tokens when it finishes


@dataclass
class HostModel:
    """CPU-only hosts: every worker's denoise loop (one thread) and its pre/post-processing share the host's cores.

    Each CPU task runs at full speed while the host has at least as many cores as runnable tasks, else all slow
    down alike (processor sharing). Tasks on different cores still slow each other (shared memory bandwidth and
    caches, the instances' helper threads): with k cores busy every task runs ``1 + interference * (k - 1)`` times
    slower. Each worker has one pre-processing and one decoding instance, so a worker's pre/post work queues FIFO
    (as Triton's single ``preprocess`` / ``vae_decode`` instances do). Entry writes (a template run's, a heal's)
    are CPU tasks too, started when the request leaves the batch."""

    cores: float
    workers_per_host: int
    pre_ms: float  # CPU time per request before denoising (image decode, text + VAE encode)
    post_ms: float  # and after (VAE decode, PNG encode)
    interference: float = 0.0
    record_ms: float = 0.0  # CPU of writing a template run's entry (in the background, as it finishes)
    heal_ms: float = 0.0  # and of a heal's rewrite


class _Host:
    """Processor sharing over a host's cores: tasks are [remaining ms of CPU at full speed, on_done]."""

    def __init__(self, cores: float, interference: float = 0.0):
        self.cores, self.interference, self.tasks, self.last, self.token = cores, interference, [], 0.0, 0

    def rate(self) -> float:
        n = len(self.tasks)
        share = 1.0 if n <= self.cores else self.cores / n
        return share / (1.0 + self.interference * max(0.0, min(n, self.cores) - 1))

    def advance(self, now: float) -> None:
        done = (now - self.last) * 1000.0 * self.rate()
        for t in self.tasks:
            t[0] -= done
        self.last = now


@dataclass
class Worker:
    load: BackendLoad
    cache: OrderedDict = field(default_factory=OrderedDict)
    cache_templates: int = 16
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    pre_queue: list = field(default_factory=list)
    post_queue: list = field(default_factory=list)
    host: _Host | None = None
    invalid: dict = field(default_factory=dict)  # template key -> tokens its entry holds invalid (bool array)
    stored: set = field(default_factory=set)  # keys whose template run has finished (entry in the store)
    healing: set = field(default_factory=set)  # keys with a heal in progress

    def holds(self, key) -> bool:
        return key in self.cache

    def touch(self, key) -> None:
        self.cache[key] = True
        self.cache.move_to_end(key)
        while len(self.cache) > self.cache_templates:
            gone, _ = self.cache.popitem(last=False)
            self.invalid.pop(gone, None)
            self.stored.discard(gone)


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


_DONE_MS = 1e-6  # a CPU task with less work left than this has finished (float round-off)


def replay(policy_name: str, workers: int, arrivals: list[tuple[float, EditFeatures]], est: Estimator,
           max_batch: int = 4, step_fixed_ms: float = 2.0, cache_templates: int = 16,
           service: Estimator | None = None, host: HostModel | None = None,
           masks: list[np.ndarray] | None = None, heal_min_ratio: float = HEAL_MIN_RATIO) -> dict:
    """Run ``arrivals`` (time in seconds, features) through the policy and ``workers`` simulated workers.
    ``masks``: each arrival's edited tokens (bool per image token); without them a hit computes just its mask ratio
    (as if every entry were a clean registration).
    ``est`` is the router's estimator; ``service`` gives the workers' true service times (default: ``est``).
    ``host``: CPU-only hosts whose cores the workers' denoise loops and pre/post-processing share; None models
    accelerator hosts (denoising never waits for the CPU; the caller adds pre/post time to each latency).
    The router refits a copy of ``est`` online from completions, as the real router does.
    Returns the finished ``SimRequest``s (``done`` is set, in arrival order) and the median routing decision."""
    service = service or est
    est = replace(est)  # the router's own copy: its online fit must not leak into the caller's or other runs
    policy = make(policy_name, est)
    ws = [Worker(BackendLoad(f"w{i}"), cache_templates=cache_templates) for i in range(workers)]
    per_host = host.workers_per_host if host else 1
    hosts = [_Host(host.cores, host.interference) if host else _Host(float("inf"))
             for _ in range(-(-workers // per_host))]
    for i, w in enumerate(ws):
        w.host = hosts[i // per_host]
    events: list = []  # (time, seq, callback(now))
    seq = itertools.count()
    finished: list[SimRequest] = []
    decision_s = []

    def at(t: float, fn) -> None:
        heapq.heappush(events, (t, next(seq), fn))

    # -- CPU tasks on a host (processor sharing) -----------------------------------------------------
    def reschedule(h: _Host, now: float) -> None:
        h.token += 1
        if h.tasks:
            token = h.token
            at(now + max(0.0, min(t[0] for t in h.tasks)) / (1000.0 * h.rate()), lambda t: host_event(h, token, t))

    def run_on(h: _Host, now: float, work_ms: float, on_done) -> None:
        h.advance(now)
        h.tasks.append([work_ms, on_done])
        reschedule(h, now)

    def host_event(h: _Host, token: int, now: float) -> None:
        if token != h.token:
            return  # superseded: the set of tasks changed since this completion was predicted
        h.advance(now)
        ended = [t for t in h.tasks if t[0] <= _DONE_MS]
        h.tasks = [t for t in h.tasks if t[0] > _DONE_MS]
        for t in ended:
            t[1](now)
        reschedule(h, now)

    # -- a worker: pre-processing queue, running batch, post-processing queue ----------------------------
    def fifo(w: Worker, queue: list, q: SimRequest, work_ms: float, then, now: float) -> None:
        """Queue ``q`` for a single-instance stage (``work_ms`` of CPU each); ``then(w, q, t)`` as each ends."""
        def start(t: float) -> None:
            run_on(w.host, t, work_ms, ended)

        def ended(t: float) -> None:
            then(w, queue.pop(0), t)
            if queue:
                start(t)
        queue.append(q)
        if len(queue) == 1:  # the instance was idle
            start(now)

    def enqueue(w: Worker, q: SimRequest, now: float) -> None:
        w.waiting.append(q)
        if not w.running:  # no step in flight: start one now (else it joins at the next step boundary)
            start_step(w, now)

    def start_step(w: Worker, now: float) -> None:
        new = set()  # templates whose run starts at this step: a request joining with it is level with it
        while w.waiting and len(w.running) < max_batch:
            q = w.waiting.pop(0)
            key = q.f.template_key
            # A template run in progress counts as held: later requests follow it (read its rows as it records
            # them), except one admitted at the same step, which computes in full.
            cached = w.holds(key) and key not in new
            work = q.f
            if not w.holds(key):
                new.add(key)
                q.records = True
                if q.mask is not None:
                    w.invalid[key] = q.mask  # its own edit is not template context
            elif cached and q.mask is not None and key in w.invalid:
                inv = w.invalid[key]
                work = replace(q.f, mask_ratio=float(computed_tokens(q.mask, inv).mean()))  # the engine's rule
                if key in w.stored and key not in w.healing and \
                        worth_healing(heal_candidates(q.mask, inv), heal_min_ratio):
                    q.heals = True
                    w.healing.add(key)
            q.steps_left, q.started = q.f.steps, now
            q.step_ms = service.request_ms(work, cached) / q.f.steps
            w.touch(key)  # recorded by its own run (miss) or refreshed (hit)
            w.running.append(q)
        if w.running:
            run_on(w.host, now, step_fixed_ms + sum(q.step_ms for q in w.running), lambda t: step_done(w, t))

    def step_done(w: Worker, now: float) -> None:
        for q in list(w.running):
            q.steps_left -= 1
            if q.steps_left == 0:
                w.running.remove(q)
                q.denoised = now
                key = q.f.template_key
                if q.records and w.holds(key):
                    w.stored.add(key)
                if q.heals:
                    w.healing.discard(key)
                    if key in w.invalid:
                        inv = w.invalid[key]
                        w.invalid[key] = after_heal(inv, heal_candidates(q.mask, inv))
                if host:  # the entry is written in the background: CPU the host's other tasks lose
                    write_ms = (host.record_ms if q.records else 0.0) + (host.heal_ms if q.heals else 0.0)
                    if write_ms:
                        run_on(w.host, now, write_ms, lambda t: None)
                if host and host.post_ms:
                    fifo(w, w.post_queue, q, host.post_ms, complete, now)
                else:
                    complete(w, q, now)
        start_step(w, now)

    def complete(w: Worker, q: SimRequest, now: float) -> None:
        q.done = now
        finished.append(q)
        q.booking.remove(w.load)
        q.booking.observed(est, (now - q.arrival) * 1000.0)

    def arrive(q: SimRequest, now: float) -> None:
        t0 = time.perf_counter()
        w = ws[[x.load for x in ws].index(policy.choose([x.load for x in ws], q.f))]
        decision_s.append(time.perf_counter() - t0)
        q.booking = Booking.add(w.load, est, q.f, now, ttl=1e9)  # router index: sim time never expires
        if host and host.pre_ms:
            fifo(w, w.pre_queue, q, host.pre_ms, enqueue, now)
        else:
            enqueue(w, q, now)

    for i, (t, f) in enumerate(arrivals):
        q = SimRequest(i, t, f, mask=None if masks is None else np.asarray(masks[i], bool))
        at(t, (lambda q: lambda now: arrive(q, now))(q))
    while events:
        now, _, fn = heapq.heappop(events)
        fn(now)
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
    profile = default_profile()
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
