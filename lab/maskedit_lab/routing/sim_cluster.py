"""The simulated cluster behind ``maskedit-router-sim`` and the validation's replay: a discrete-event model of N
workers and the router in front of them.

N simulated workers each run step-level continuous batching (max batch 4): a step takes the sum of its requests'
per-step times from the measured cost-model profile (on this CPU a step's cost grows with the batch), a request on a
template the worker holds computes only its masked tokens (kv blocks), otherwise the full model, after which the worker
holds the template (LRU of ``cache_templates``) from the start of that template run, as the engine lets later requests
follow a run in progress. Given each request's token mask, a worker also tracks which tokens of each entry are invalid
(the template run's own edit): a hit computes its mask and those, and heals them as the engine does (a hit on a stored
entry that leaves at least ``heal_min_ratio`` of the tokens' invalid ones unmasked makes them valid when it completes).
Optionally (``HostModel``) workers share CPU-only hosts with their pre/post-processing, as on the machine the validation
runs on. The router side is the real policy code (``maskedit_router.placement.policies``) with the router's own
bookkeeping.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from maskedit_common.heal import HEAL_MIN_RATIO, after_heal, computed_tokens, heal_candidates, worth_healing
from maskedit_router.placement.features import EditFeatures
from maskedit_router.placement.policies import BackendLoad, Booking, Estimator, make


@dataclass
class SimRequest:
    rid: int
    arrival: float
    f: EditFeatures
    steps_left: int = 0
    step_ms: float = 0.0
    enqueued: float | None = None  # pre-processing done: in its worker's denoise queue
    started: float | None = None  # joined a running batch
    denoised: float | None = None  # left it
    done: float | None = None
    booking: Booking | None = None  # its entry in the router's account
    mask: np.ndarray | None = None  # its edited tokens (bool per image token), when known
    records: bool = False  # a template run: its entry is stored when it finishes
    cached: bool = False  # computes from its template's entry (kv blocks)
    heals: bool = False  # a hit that heals its entry's invalid tokens when it finishes
    join_ms: float = 0.0  # one-off work added to the step it joins (disk read, checkpoint load)
    computed: int | None = None  # image tokens it computed (a hit: its mask and its entry's invalid ones)


@dataclass
class HostModel:
    """CPU-only hosts: every worker's denoise loop (one thread) and its pre/post-processing share the host's cores.

    Each CPU task runs at full speed while the host has at least as many cores as runnable tasks, else all slow
    down alike (processor sharing). Tasks on different cores still slow each other (shared memory bandwidth and
    caches, the instances' helper threads): with k cores busy every task runs ``1 + interference * (k - 1)`` times
    slower. How much depends on what the steps read: a cached request's step streams its entry's activations from
    host memory, so two steps that each carry a full batch of cached requests can contend more than two batch-1
    steps (the validation's full-batch probe measured 0.14-1.01 where its batch-1 probe measured 0.03-0.12).
    ``interference_full`` is that pair's figure; a pair of steps with ``a`` and ``b`` cached requests gets
    ``interference + (interference_full - interference) * fill(a) * fill(b)``, ``fill(n) = (n - 1) / (max_batch - 1)``
    clipped to [0, 1] (pre/post-processing and writes read no entry: fill 0), and the host's figure is the mean over
    its busy pairs. None: the batch-1 figure for every pair (files calibrated before the full-batch probe).
    ``background``: CPU the host spent on work outside the workers, as (from second, cores busy) steps (a measured
    run's ``HostSampler`` record); it competes for the cores like that many more runnable tasks.
    Each worker has one pre-processing and one decoding instance, so a worker's pre/post work queues FIFO
    (as Triton's single ``preprocess`` / ``vae_decode`` instances do). Entry writes (a template run's, a heal's)
    are CPU tasks too, started when the request leaves the batch.
    ``slowdown`` and ``noise_cv`` ask what-if questions of a calibrated host (``validate_sensitivity``): every CPU
    task's work times ``slowdown`` (the host that much slower than calibrated, all run long), and times a lognormal
    draw of mean 1 and this coefficient of variation per task (``noise_seed``: its generator's seed)."""

    cores: float
    workers_per_host: int
    pre_ms: float  # CPU time per request before denoising (image decode, text + VAE encode)
    post_ms: float  # and after (VAE decode, PNG encode)
    interference: float = 0.0
    record_ms: float = 0.0  # CPU of writing a template run's entry (in the background, as it finishes)
    heal_ms: float = 0.0  # and of a heal's rewrite
    interference_full: float | None = None  # two full batches of cached requests, one on each of two cores
    background: tuple[tuple[float, float], ...] = ()  # (from second, foreign cores busy), in time order
    slowdown: float = 1.0
    noise_cv: float = 0.0
    noise_seed: int = 0


def _what_if(host: HostModel | None):
    """A CPU task's work factor under ``host``'s ``slowdown`` and ``noise_cv`` (1 without either)."""
    if host is None or host.noise_cv <= 0:
        slowdown = host.slowdown if host else 1.0
        return lambda: slowdown
    rng = np.random.default_rng(host.noise_seed)
    sigma = float(np.sqrt(np.log1p(host.noise_cv ** 2)))
    return lambda: host.slowdown * float(rng.lognormal(-sigma * sigma / 2, sigma))


class _Host:
    """Processor sharing over a host's cores: tasks are [remaining ms of CPU at full speed, on_done, fill, kind]
    where fill (0-1) is how full of cached requests a denoise step is (``HostModel``). ``cpu_ms``: per kind, the CPU
    time its tasks were given from time 0 on (a task on a core for 1 ms is given 1 ms, however slowly the
    interference makes it go: what a process's CPU clock would read)."""

    def __init__(self, cores: float, interference: float = 0.0, interference_full: float | None = None):
        self.cores, self.interference, self.tasks, self.last, self.token = cores, interference, [], 0.0, 0
        self.interference_full = interference_full
        self.background = 0.0  # cores busy with work outside the workers (``HostModel.background``)
        self.cpu_ms: dict[str, float] = {}

    def pair_interference(self) -> float:
        if self.interference_full is None or len(self.tasks) < 2:
            return self.interference
        fill = [t[2] for t in self.tasks]
        n = len(fill)
        pairs = (sum(fill) ** 2 - sum(f * f for f in fill)) / 2  # sum over pairs of fill_a * fill_b
        return self.interference + (self.interference_full - self.interference) * pairs / (n * (n - 1) / 2)

    def rate(self) -> float:
        n = len(self.tasks) + self.background
        return self.share() / (1.0 + self.pair_interference() * max(0.0, min(n, self.cores) - 1))

    def share(self) -> float:
        n = len(self.tasks) + self.background
        return 1.0 if n <= self.cores else self.cores / n

    def advance(self, now: float) -> None:
        done = (now - self.last) * 1000.0 * self.rate()
        given = max(0.0, now - max(self.last, 0.0)) * 1000.0 * self.share()  # (the lead before 0 is not counted)
        for t in self.tasks:
            t[0] -= done
            self.cpu_ms[t[3]] = self.cpu_ms.get(t[3], 0.0) + given
        self.last = now


def batch_fill(cached: int, max_batch: int) -> float:
    """How full of cached requests a step is, for ``HostModel``'s interference: 0 at one, 1 at ``max_batch``."""
    return min(1.0, max(0.0, (cached - 1) / max(1, max_batch - 1)))


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


def batch_shared_ms(est: Estimator) -> float:
    """Milliseconds of a cached request's step that a batch pays once: the engine packs a step's requests into
    one transformer call, so each block's fixed cost (the constant of its profile fit in kv mode: kernel launches,
    weight reads) is not paid per request. In ``est``'s units (its scale, a calibration's speed ratio)."""
    cost = est.cost
    if cost.fallback_flops_per_ms or not cost.compute:
        return 0.0
    probe = EditFeatures("probe", 0.1, 1024, 1)
    unscaled = est._unscaled_ms(probe.mask_ratio, probe.tokens, 1, True)
    units = est.request_ms(probe, True) / unscaled if unscaled > 0 else 1.0
    fixed = sum(count * max(0.0, cost.compute[kind]["kv"].coef[0]) for kind, count, _, _ in est.blocks
                if "kv" in cost.compute.get(kind, {}))
    return fixed * units


_DONE_MS = 1e-6  # a CPU task with less work left than this has finished (float round-off)


def replay(policy_name: str, workers: int, arrivals: list[tuple[float, EditFeatures]], est: Estimator,
           max_batch: int = 4, step_fixed_ms: float = 2.0, cache_templates: int = 16,
           service: Estimator | None = None, host: HostModel | None = None,
           masks: list[np.ndarray] | None = None, heal_min_ratio: float = HEAL_MIN_RATIO,
           disk_templates: int = 0, model_slots: int = 2, policy_kw: dict | None = None,
           batch_shared: float | None = None, names: list[str] | None = None, policy=None,
           held: dict[str, list] | None = None) -> dict:
    """Run ``arrivals`` (time in seconds, features) through the policy and ``workers`` simulated workers.
    ``masks``: each arrival's edited tokens (bool per image token); without them a hit computes just its mask ratio
    (as if every entry were a clean registration).
    ``est`` is the router's estimator; ``service`` gives the workers' true service times (default: ``est``).
    ``names``: the workers' names as the router knows them (``chwbl`` hashes them; default w0, w1, ...); ``policy``:
    a policy object instead of ``policy_name``'s. ``held``: worker name -> template keys whose entries its store
    already holds, clean, when the replay starts (registered outside the router, e.g. by an earlier measurement's
    probes sent to the instance directly: the router's shadow does not know them). ``batch_shared``: ms of a cached
    request's step a batch pays once (default: ``batch_shared_ms(service)``, from the profile).
    ``host``: CPU-only hosts whose cores the workers' denoise loops and pre/post-processing share; None models
    accelerator hosts (denoising never waits for the CPU; the caller adds pre/post time to each latency).
    The router refits a copy of ``est`` online from completions, as the real router does.
    Stores: a memory tier of ``cache_templates`` entries and a disk tier of ``disk_templates`` (an entry read from
    disk costs ``service.tier_load_ms("disk")`` when its request joins the batch); ``model_slots`` base checkpoints
    resident per worker (a request whose checkpoint is not costs ``service.model_ms`` when it joins). The router's
    shadow of each store has the same capacities.
    Returns the finished ``SimRequest``s (``done`` is set, in arrival order), the median routing decision, and the
    CPU the hosts' tasks were given from time 0 on, by kind (``cpu_ms``: denoise, write, pre, post)."""
    service = service or est
    shared_ms = batch_shared_ms(service) if batch_shared is None else batch_shared
    est = replace(est)  # the router's own copy: its online fit must not leak into the caller's or other runs
    policy = policy or make(policy_name, est, **(policy_kw or {}))
    names = names or [f"w{i}" for i in range(workers)]
    ws = [Worker(BackendLoad(names[i], mem_templates=cache_templates, disk_templates=disk_templates,
                             model_slots=model_slots), cache_templates=cache_templates, disk_templates=disk_templates,
                 model_slots=model_slots) for i in range(workers)]
    loads = [w.load for w in ws]
    by_name = {w.load.name: w for w in ws}
    for name, keys in (held or {}).items():
        for key in keys:
            by_name[name].touch(key)
            by_name[name].stored.add(key)
    cold = {"model_loads": 0, "disk_reads": 0, "misses": 0, "adapter_loads": 0}
    per_host = host.workers_per_host if host else 1
    hosts = [_Host(host.cores, host.interference, host.interference_full) if host else _Host(float("inf"))
             for _ in range(-(-workers // per_host))]
    for i, w in enumerate(ws):
        w.host = hosts[i // per_host]
    what_if = _what_if(host)
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

    def run_on(h: _Host, now: float, work_ms: float, on_done, fill: float = 0.0, kind: str = "denoise") -> None:
        h.advance(now)
        h.tasks.append([work_ms * what_if(), on_done, fill, kind])
        reschedule(h, now)

    def set_background(h: _Host, cores: float, now: float) -> None:
        h.advance(now)
        h.background = cores
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
    def fifo(w: Worker, queue: list, q: SimRequest, work_ms: float, then, now: float, kind: str) -> None:
        """Queue ``q`` for a single-instance stage (``work_ms`` of CPU each); ``then(w, q, t)`` as each ends."""
        def start(t: float) -> None:
            run_on(w.host, t, work_ms, ended, kind=kind)

        def ended(t: float) -> None:
            then(w, queue.pop(0), t)
            if queue:
                start(t)
        queue.append(q)
        if len(queue) == 1:  # the instance was idle
            start(now)

    def enqueue(w: Worker, q: SimRequest, now: float) -> None:
        q.enqueued = now
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
            q.computed = round(work.mask_ratio * work.tokens) if cached else work.tokens
            q.step_ms = service.request_ms(work, cached) / q.f.steps
            q.cached = cached
            w.touch(key)  # recorded by its own run (miss) or refreshed (hit)
            w.running.append(q)
        if w.running:
            extra = sum(q.join_ms for q in w.running)
            for q in w.running:
                q.join_ms = 0.0
            # one packed transformer call per step: its cached requests' fixed per-block cost is paid once
            shared = shared_ms * max(0, sum(q.cached for q in w.running) - 1)
            run_on(w.host, now, step_fixed_ms + extra + sum(q.step_ms for q in w.running) - shared,
                   lambda t: step_done(w, t), batch_fill(sum(q.cached for q in w.running), max_batch))

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
                        run_on(w.host, now, write_ms, lambda t: None, kind="write")
                if host and host.post_ms:
                    fifo(w, w.post_queue, q, host.post_ms, complete, now, "post")
                else:
                    complete(w, q, now)
        start_step(w, now)

    def complete(w: Worker, q: SimRequest, now: float) -> None:
        q.done = now
        finished.append(q)
        q.booking.remove(w.load, now)
        q.booking.observed(est, (now - q.arrival) * 1000.0)
        if q.f.temporal is not None:  # the router learns what its policy computed (the EDIT_INFO it would read)
            est.observe_temporal(q.f.temporal, service.computed_fraction(q.f))

    def arrive(q: SimRequest, now: float) -> None:
        t0 = time.perf_counter()
        w = by_name[policy.choose(loads, q.f, now).name]
        decision_s.append(time.perf_counter() - t0)
        q.booking = Booking.add(w.load, est, q.f, now, ttl=1e9)  # router index: sim time never expires
        if host and host.pre_ms:
            fifo(w, w.pre_queue, q, host.pre_ms, enqueue, now, "pre")
        else:
            enqueue(w, q, now)

    for t, cores in (host.background if host else ()):
        for h in hosts:
            at(t, (lambda h, cores: lambda now: set_background(h, cores, now))(h, cores))
    for i, (t, f) in enumerate(arrivals):
        q = SimRequest(i, t, f, mask=None if masks is None or masks[i] is None else np.asarray(masks[i], bool))
        at(t, (lambda q: lambda now: arrive(q, now))(q))
    while events:
        now, _, fn = heapq.heappop(events)
        fn(now)
    return {"requests": sorted(finished, key=lambda q: q.rid), "estimator": est,
            "decision_us_p50": float(np.percentile(decision_s, 50) * 1e6) if decision_s else 0.0,
            "decision_us_p99": float(np.percentile(decision_s, 99) * 1e6) if decision_s else 0.0, **cold,
            "cpu_ms": {k: sum(h.cpu_ms.get(k, 0.0) for h in hosts) for k in {k for h in hosts for k in h.cpu_ms}}}
