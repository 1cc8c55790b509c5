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
from maskedit_router.policies import POLICIES, BackendLoad, Booking, Estimator, make

from . import REPO_ROOT



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
    join_ms: float = 0.0  # one-off work added to the step it joins (disk read, checkpoint load)


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
    cache: OrderedDict = field(default_factory=OrderedDict)  # the store's memory tier (LRU of ``cache_templates``)
    cache_templates: int = 16
    disk: OrderedDict = field(default_factory=OrderedDict)  # its disk tier: what the memory tier evicted
    disk_templates: int = 0
    models: OrderedDict = field(default_factory=OrderedDict)  # resident base checkpoints (LRU of ``model_slots``)
    model_slots: int = 2
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    pre_queue: list = field(default_factory=list)
    post_queue: list = field(default_factory=list)
    host: _Host | None = None
    invalid: dict = field(default_factory=dict)  # template key -> tokens its entry holds invalid (bool array)
    stored: set = field(default_factory=set)  # keys whose template run has finished (entry in the store)
    healing: set = field(default_factory=set)  # keys with a heal in progress
    adapters: OrderedDict = field(default_factory=OrderedDict)  # LoRA adapters in its host cache (LRU)
    adapter_slots: int = 32

    def holds(self, key) -> bool:
        return key in self.cache or key in self.disk

    def tier(self, key) -> str | None:
        return "mem" if key in self.cache else "disk" if key in self.disk else None

    def touch(self, key) -> None:
        self.disk.pop(key, None)
        self.cache[key] = True
        self.cache.move_to_end(key)
        while len(self.cache) > self.cache_templates:
            gone, _ = self.cache.popitem(last=False)
            if self.disk_templates:
                self.disk[gone] = True
            else:
                self._drop(gone)
        while len(self.disk) > self.disk_templates:
            gone, _ = self.disk.popitem(last=False)
            self._drop(gone)

    def _drop(self, key) -> None:
        self.invalid.pop(key, None)
        self.stored.discard(key)

    def load_adapters(self, names) -> int:
        """Make ``names`` resident; how many had to be loaded (cold)."""
        cold = 0
        for n in names:
            cold += n not in self.adapters
            self.adapters[n] = True
            self.adapters.move_to_end(n)
        while len(self.adapters) > self.adapter_slots:
            self.adapters.popitem(last=False)
        return cold

    def load_model(self, model, in_use) -> bool:
        """Make ``model`` resident; True if it had to be loaded. Evicts the least recently used checkpoint that no
        running request needs (over budget for a while when every resident one is in use)."""
        if model is None:
            return False
        cold = model not in self.models
        self.models[model] = True
        self.models.move_to_end(model)
        for m in list(self.models):
            if len(self.models) <= self.model_slots:
                break
            if m != model and m not in in_use:
                del self.models[m]
        return cold


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
           masks: list[np.ndarray] | None = None, heal_min_ratio: float = HEAL_MIN_RATIO,
           disk_templates: int = 0, model_slots: int = 2, policy_kw: dict | None = None) -> dict:
    """Run ``arrivals`` (time in seconds, features) through the policy and ``workers`` simulated workers.
    ``masks``: each arrival's edited tokens (bool per image token); without them a hit computes just its mask ratio
    (as if every entry were a clean registration).
    ``est`` is the router's estimator; ``service`` gives the workers' true service times (default: ``est``).
    ``host``: CPU-only hosts whose cores the workers' denoise loops and pre/post-processing share; None models
    accelerator hosts (denoising never waits for the CPU; the caller adds pre/post time to each latency).
    The router refits a copy of ``est`` online from completions, as the real router does.
    Stores: a memory tier of ``cache_templates`` entries and a disk tier of ``disk_templates`` (an entry read from
    disk costs ``service.tier_load_ms("disk")`` when its request joins the batch); ``model_slots`` base checkpoints
    resident per worker (a request whose checkpoint is not costs ``service.model_ms`` when it joins). The router's
    shadow of each store has the same capacities.
    Returns the finished ``SimRequest``s (``done`` is set, in arrival order) and the median routing decision."""
    service = service or est
    est = replace(est)  # the router's own copy: its online fit must not leak into the caller's or other runs
    policy = make(policy_name, est, **(policy_kw or {}))
    ws = [Worker(BackendLoad(f"w{i}", mem_templates=cache_templates, disk_templates=disk_templates,
                             model_slots=model_slots), cache_templates=cache_templates, disk_templates=disk_templates,
                 model_slots=model_slots) for i in range(workers)]
    loads = [w.load for w in ws]
    by_name = {w.load.name: w for w in ws}
    cold = {"model_loads": 0, "disk_reads": 0, "misses": 0, "adapter_loads": 0}
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
            tier = w.tier(key)
            cached = tier is not None and key not in new
            work = q.f
            extra = 0.0  # one-off work when it joins: its entry's read from disk, its checkpoint's load
            if cached and tier == "disk":
                extra += service.tier_load_ms("disk")
                cold["disk_reads"] += 1
            if w.load_model(q.f.model, {r.f.model for r in w.running}):
                extra += service.model_ms(q.f, BackendLoad("cold"))  # the checkpoint (with unnamed adapters)
                cold["model_loads"] += 1
            k = w.load_adapters(q.f.adapters)  # named adapters: each loaded where it is not resident
            extra += k * service.lora_load_ms
            cold["adapter_loads"] += k
            q.join_ms = extra
            if not w.holds(key):
                cold["misses"] += 1
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
            extra = sum(q.join_ms for q in w.running)
            for q in w.running:
                q.join_ms = 0.0
            run_on(w.host, now, step_fixed_ms + extra + sum(q.step_ms for q in w.running), lambda t: step_done(w, t))

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
        q.booking.remove(w.load, now)
        q.booking.observed(est, (now - q.arrival) * 1000.0)

    def arrive(q: SimRequest, now: float) -> None:
        t0 = time.perf_counter()
        w = by_name[policy.choose(loads, q.f, now).name]
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
            "decision_us_p50": float(np.percentile(decision_s, 50) * 1e6) if decision_s else 0.0,
            "decision_us_p99": float(np.percentile(decision_s, 99) * 1e6) if decision_s else 0.0, **cold}


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


def simulate_trace(policy_name: str, workers: int, load: float, wl: TraceWorkload, est: Estimator,
                   slo_scale: float = 2.0, cache_templates: int = 16, disk_templates: int = 64, model_slots: int = 2,
                   max_batch: int = 4, step_fixed_ms: float = 2.0) -> dict:
    """One cell: ``wl`` at ``load`` x the cluster's all-hit capacity on ``workers`` simulated workers."""
    fs = wl.features(est, slo_scale)
    rate = load * workers / ideal_service_s(fs, est, step_fixed_ms)
    arrivals = list(zip(wl.arrivals(rate).tolist(), fs))
    out = replay(policy_name, workers, arrivals, est, max_batch=max_batch, step_fixed_ms=step_fixed_ms,
                 cache_templates=cache_templates, disk_templates=disk_templates, model_slots=model_slots)
    lat = np.array([q.done - q.arrival for q in out["requests"]])
    ok = np.array([q.done - q.arrival <= q.f.deadline_s for q in out["requests"]])
    n = len(lat)
    return {"policy": policy_name, "workers": workers, "load": load, "rate": round(rate, 3),
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

    def run(p, w, load, kind):
        t0 = time.perf_counter()
        row = dict(simulate_trace(p, w, load, wl, est, **kw), kind=kind)
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

    rows = [r for r in rows if not r.get("validation")]
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
