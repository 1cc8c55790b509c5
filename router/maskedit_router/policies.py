"""Routing policies: one implementation used by the router (``--policy``), the endpoint picker (which routes through
the router) and the simulator (``maskedit_lab.router_sim``).

The default, ``predicted``, predicts each backend's completion latency for the new request (InstGenIE Algorithm 2,
made explicit), in milliseconds:
    backlog(b, now)                    predicted remaining work of b's in-flight requests: booked work less what b
                                       has worked off since (it drains at 1 ms per ms while b is busy), so a queue of
                                       nearly finished requests is not costed as a fresh one
  + compute(r, tier)                   r's denoising at its mask ratio and steps: cached blocks (kv) when b holds the
                                       template's activations, the full model otherwise (a template run)
  + tier_load(r, tier)                 bringing the activations in: 0 from the memory tier, the profile's measured disk
                                       read of an entry from the disk tier
  + model_load(r, b)                   the base checkpoint (and its LoRAs) r needs, when b does not hold it resident
plus the extra work a placement costs the cluster (a template run or checkpoint load where a cached, resident
placement existed), weighted by the requests in flight on the backend it would delay (``PredictedLatency``).
A request with a deadline and slack picks, among the backends predicted to meet it (with a margin), the one where it
costs the least work (its cache entry and checkpoint are there): the capacity it saves is the other requests'
latency. The router keeps its own books: per backend the work it booked, a shadow of the backend's store (a memory
tier and a disk tier of the templates it routed there, LRU at the store's capacities) and of its resident
checkpoints.

Baselines, each with its documented defaults and only the information a real deployment of it has:
``round_robin``, ``least_requests``, ``least_masked_tokens``; the affinity-aware ``chwbl`` (consistent hashing with
bounded loads on the template key, Mirrokni et al. 2018 as in HAProxy/Envoy: load factor 1.25, 100 virtual nodes
per backend), ``p2c`` (power of two choices on outstanding work, masked tokens x steps) and ``weighted`` (an
llm-d / Gateway API Inference Extension style weighted sum of normalised scorers: template affinity, queue depth,
store utilisation; weights prefix-cache 3, queue 2, kv-cache utilisation 2 as llm-d's documented profile).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from maskedit_common.cost_model import CostModel

from .features import EditFeatures

MEM, DISK = "mem", "disk"


@dataclass
class BackendLoad:
    """What the router knows about one backend: its books and a shadow of its store and resident checkpoints."""

    name: str
    inflight: int = 0
    masked_tokens: int = 0  # sum over in-flight requests
    work: int = 0  # outstanding work: masked tokens x steps, summed over in-flight requests
    backlog_ms: float = 0.0  # predicted work of in-flight requests, as booked
    # the store's memory tier as the router routed to it: template key -> expiry (monotonic seconds), LRU order
    templates: OrderedDict = field(default_factory=OrderedDict)
    disk: OrderedDict = field(default_factory=OrderedDict)  # the disk tier: what the memory tier evicted
    models: OrderedDict = field(default_factory=OrderedDict)  # resident checkpoints (LRU)
    healthy: bool = True
    mem_templates: int = 16  # the store's capacities in entries (its byte budgets / an entry's size)
    disk_templates: int = 64
    model_slots: int = 2  # checkpoints resident at once
    drained_ms: float = 0.0  # booked work worked off since (``backlog_at``)
    drain_t: float | None = None

    def tier(self, key: str | None, now: float) -> str | None:
        """Where the backend likely holds ``key``'s entry: ``mem``, ``disk`` or None."""
        if not key:
            return None
        exp = self.templates.get(key)
        if exp is not None and exp > now:
            return MEM
        exp = self.disk.get(key)
        return DISK if exp is not None and exp > now else None

    def holds(self, key: str | None, now: float) -> bool:
        return self.tier(key, now) is not None

    def holds_model(self, model: str | None) -> bool:
        return model is None or model in self.models

    def touch(self, key: str | None, expiry: float) -> None:
        """``key`` was just routed here: its entry will be (or is) in the memory tier."""
        if not key:
            return
        self.disk.pop(key, None)
        self.templates[key] = expiry
        self.templates.move_to_end(key)
        while len(self.templates) > self.mem_templates:
            old, exp = self.templates.popitem(last=False)
            self.disk[old] = exp
        while len(self.disk) > self.disk_templates:
            self.disk.popitem(last=False)

    def touch_model(self, model: str | None) -> None:
        if model is None:
            return
        self.models[model] = True
        self.models.move_to_end(model)
        while len(self.models) > self.model_slots:
            self.models.popitem(last=False)

    def forget(self) -> None:
        """Its caches are no longer trusted (it failed)."""
        self.templates.clear()
        self.disk.clear()
        self.models.clear()

    def utilisation(self) -> float:
        """Fill of the store's memory tier (what llm-d's kv-cache utilisation scorer reads from a pod)."""
        return min(1.0, len(self.templates) / max(1, self.mem_templates))

    def backlog_at(self, now: float) -> float:
        """Booked work less what the backend has worked off since (1 ms per ms while it has work)."""
        self._drain(now)
        return max(0.0, self.backlog_ms - self.drained_ms)

    def _drain(self, now: float) -> None:
        if self.drain_t is not None and now > self.drain_t:
            self.drained_ms = min(self.backlog_ms, self.drained_ms + (now - self.drain_t) * 1000.0)
        self.drain_t = now


@dataclass
class Estimator:
    """Predicted denoise milliseconds of one request from the cost model (the engine's profile)."""

    cost: CostModel
    dual: int = 4
    single: int = 8
    dim: int = 256
    text: int = 64
    default_steps: int = 8
    scale: float = 1.0  # refitted online: observed / predicted
    # Recent |ln(observed / predicted)| (EMA; symmetric in over- and under-prediction). Beyond ``stale_error``
    # (default: typically off by more than 4x) the model no longer describes the backends (new hardware, a profile
    # of another model) and policies fall back to a score without it.
    error: float = 0.0
    stale_error: float = math.log(4.0)
    observations: int = 0
    entry_bytes: int = 300_000_000  # an activation-store entry of the served model (a template's)
    model_load_ms: float = 0.0  # loading a base checkpoint that is not resident (0: one model, always resident)
    lora_load_ms: float = 0.0  # and each of its LoRA adapters

    def __post_init__(self):
        # The served model's blocks as its profile recorded them: runs of [kind, count, tokens, width], the tokens
        # relative to the image tokens of the router's grid, so any model family (Flux's blocks all at the image's
        # tokens, a UNet's per level with both guidance rows) is predicted without importing it. A profile
        # without them: ``dual`` + ``single`` Flux blocks of width ``dim`` at the image's tokens.
        meta = self.cost.meta
        if meta.get("blocks") and meta.get("grid_tokens"):
            self.blocks = [(str(k), int(cnt), tokens / meta["grid_tokens"], int(d)) for k, cnt, tokens, d in
                           meta["blocks"]]
            self.text = int(meta.get("text", self.text))
        else:
            self.blocks = [("dual", self.dual, 1.0, self.dim), ("single", self.single, 1.0, self.dim)]
        self._memo: dict = {}

    def request_ms(self, f: EditFeatures, cached: bool) -> float:
        return self.scale * self._unscaled_ms(f.mask_ratio, f.tokens, f.steps or self.default_steps, cached)

    def _unscaled_ms(self, ratio: float, tokens: int, steps: int, cached: bool) -> float:
        key = (round(ratio, 4), tokens, steps, cached)
        got = self._memo.get(key)
        if got is not None:
            return got
        per_step = 0.0
        for kind, count, share, dim in self.blocks:
            n = max(1, int(round(share * tokens)))
            # (a UNet's coarser levels see a mask a little dilated; the online refit absorbs that)
            c = max(1, int(round(ratio * n)))
            full = self.cost.block_ms(kind, "full", n, n, self.text, dim)
            # The engine's planner never runs a block from the cache slower than computing it in full: a fit
            # extrapolated past its calibrated sizes must not make a cache hit look dearer than a miss.
            per_step += count * (min(full, self.cost.block_ms(kind, "kv", n, c, self.text, dim)) if cached else full)
        if len(self._memo) > 50_000:
            self._memo.clear()
        self._memo[key] = steps * per_step
        return steps * per_step

    def tier_load_ms(self, tier: str | None) -> float:
        """Bringing an entry in from ``tier`` (the profile's measured reads; the memory tier is mapped, ~free)."""
        return self.scale * self.cost.load_ms(self.entry_bytes, DISK) if tier == DISK else 0.0

    def model_ms(self, f: EditFeatures, load: BackendLoad) -> float:
        if f.model is None or load.holds_model(f.model):
            return 0.0
        return self.model_load_ms + f.loras * self.lora_load_ms

    def eviction_ms(self, f: EditFeatures, load: BackendLoad) -> float:
        """What loading ``f``'s checkpoint on ``load`` costs later: with every slot taken it evicts the least recently
        used checkpoint, which its next request there loads again (charged to the choice, not to the backlog)."""
        if f.model is None or load.holds_model(f.model) or len(load.models) < load.model_slots:
            return 0.0
        return self.model_load_ms

    def cost_ms(self, f: EditFeatures, load: BackendLoad, now: float, hit_ms: float | None = None,
                miss_ms: float | None = None) -> float:
        """The request's own work on ``load``: compute at the tier its entry is in, the entry's load, the model's."""
        tier = load.tier(f.template_key, now)
        if tier is None:
            c = self.request_ms(f, False) if miss_ms is None else miss_ms
        else:
            c = (self.request_ms(f, True) if hit_ms is None else hit_ms) + self.tier_load_ms(tier)
        return c + self.model_ms(f, load)

    def observe(self, predicted_ms: float, observed_ms: float, predicted_scale: float | None = None,
                alpha: float = 0.1) -> None:
        """A request predicted to complete in ``predicted_ms`` (at routing time, with the scale then:
        ``predicted_scale``, default the current one) took ``observed_ms``. The fit moves toward observed /
        unscaled prediction; relative to the scale *at prediction*, so a burst routed before any completion does
        not compound its error into the scale."""
        if predicted_ms > 0 and observed_ms > 0:
            at = self.scale if predicted_scale is None else predicted_scale
            self.error += alpha * (abs(math.log(observed_ms / predicted_ms)) - self.error)
            self.scale += alpha * (observed_ms / predicted_ms * at - self.scale)
            self.observations += 1

    @property
    def stale(self) -> bool:
        return self.error > self.stale_error


@dataclass
class Booking:
    """A routed request's entry in its backend's account, kept until it ends. The router and the simulator book
    through this one class, so the simulated router keeps exactly the real one's books."""

    predicted_ms: float  # the request's own work, as added to the backend's backlog
    expected_ms: float  # its predicted completion latency: the backlog it joined plus its own work
    scale: float  # the estimator's scale when it was predicted
    masked: int
    work: int = 0  # masked tokens x steps

    @classmethod
    def add(cls, load: BackendLoad, est: Estimator, f: EditFeatures, now: float, ttl: float) -> "Booking":
        predicted = est.cost_ms(f, load, now)
        masked = int(round(f.mask_ratio * f.tokens))
        b = cls(predicted, load.backlog_at(now) + predicted, est.scale, masked,
                masked * (f.steps or est.default_steps) if f.runs_edit else 0)
        load.inflight += 1
        load.masked_tokens += b.masked
        load.work += b.work
        load.backlog_ms += predicted
        load.touch(f.template_key, now + ttl)  # "just routed this template here": its activations will be there
        load.touch_model(f.model)
        return b

    def remove(self, load: BackendLoad, now: float | None = None) -> None:
        load._drain(time.monotonic() if now is None else now)
        load.inflight = max(0, load.inflight - 1)
        load.masked_tokens = max(0, load.masked_tokens - self.masked)
        load.work = max(0, load.work - self.work)
        load.backlog_ms = max(0.0, load.backlog_ms - self.predicted_ms)
        # this request's work has been worked off (it ended): what was drained on its account goes with it
        load.drained_ms = max(0.0, min(load.backlog_ms, load.drained_ms - self.predicted_ms))
        if load.inflight == 0:
            load.backlog_ms = load.drained_ms = 0.0

    def observed(self, est: Estimator, observed_ms: float) -> None:
        """Refit against what the policy predicted (completion latency), not the bare service time: under load
        the latter would read queueing as slowness and inflate every backlog."""
        est.observe(self.expected_ms, observed_ms, self.scale)


class Policy:
    name = "base"

    def choose(self, backends: list[BackendLoad], f: EditFeatures, now: float | None = None) -> BackendLoad:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._n = itertools.count()

    def choose(self, backends, f, now=None):
        return backends[next(self._n) % len(backends)]


class LeastRequests(Policy):
    name = "least_requests"

    def choose(self, backends, f, now=None):
        return min(backends, key=lambda b: (b.inflight, b.name))


class LeastMaskedTokens(Policy):
    name = "least_masked_tokens"

    def choose(self, backends, f, now=None):
        return min(backends, key=lambda b: (b.masked_tokens, b.inflight, b.name))


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class ConsistentHashBoundedLoads(Policy):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018; HAProxy's
    ``hash-balance-factor``, Envoy's ``hash_balance_factor``) on the template key.

    Each backend has ``vnodes`` points on a 64-bit ring. A request walks the ring clockwise from its key's hash and
    takes the first backend whose load is within the bound ``ceil(load_factor * (total + 1) / n)`` (load: requests
    in flight, the new one included). Some backend is always within the bound, so the walk ends. A request without a
    template key (no cache to be affine to) goes to the least loaded."""

    name = "chwbl"

    def __init__(self, load_factor: float = 1.25, vnodes: int = 100):
        if load_factor < 1.0:
            raise ValueError(f"load_factor: must be >= 1, got {load_factor}")
        self.load_factor, self.vnodes = load_factor, vnodes
        self._names: tuple = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, names: tuple) -> None:
        if names == self._names:
            return
        pts = sorted((_hash64(f"{n}#{i}"), n) for n in names for i in range(self.vnodes))
        self._points, self._owners, self._names = [p for p, _ in pts], [n for _, n in pts], names

    def bound(self, backends) -> int:
        total = sum(b.inflight for b in backends)
        return math.ceil(self.load_factor * (total + 1) / len(backends))

    def choose(self, backends, f, now=None):
        if not f.template_key:
            return min(backends, key=lambda b: (b.inflight, b.name))
        by_name = {b.name: b for b in backends}
        self._ring(tuple(sorted(by_name)))
        bound = self.bound(backends)
        i = bisect.bisect_left(self._points, _hash64(f.template_key))
        seen: set = set()
        for k in range(len(self._points)):
            name = self._owners[(i + k) % len(self._points)]
            if name in seen:
                continue
            seen.add(name)
            if by_name[name].inflight + 1 <= bound:
                return by_name[name]
        return min(backends, key=lambda b: (b.inflight, b.name))  # unreachable: the bound admits one


class PowerOfTwoChoices(Policy):
    """Sample two distinct backends uniformly at random, send to the one with less outstanding work (masked tokens x
    steps of its in-flight requests; then fewer requests)."""

    name = "p2c"

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def choose(self, backends, f, now=None):
        if len(backends) == 1:
            return backends[0]
        a, b = self.rng.sample(backends, 2)
        return min((a, b), key=lambda x: (x.work, x.inflight))


WEIGHTED_DEFAULTS = {"affinity": 3.0, "queue": 2.0, "utilisation": 2.0}


class WeightedScorers(Policy):
    """An llm-d / GIE endpoint-picker style mix: each scorer gives every candidate a score in [0, 1] (1 best), the
    backend with the highest weighted sum wins (ties: fewer requests, then name). Scorers:
    ``affinity`` — 1 if the router's index says the backend holds the template (llm-d's prefix-cache scorer: the
    fraction of the request's cache prefix it routed there), else 0; ``queue`` — min-max normalised requests in
    flight, fewest = 1 (llm-d's queue scorer; all equal: 1); ``utilisation`` — 1 - the fill of the backend's memory
    tier (llm-d's kv-cache utilisation scorer). Weights: ``WEIGHTED_DEFAULTS`` (llm-d's documented profile:
    prefix-cache 3, queue 2, kv-cache utilisation 2), normalised to sum to 1."""

    name = "weighted"

    def __init__(self, weights: dict | None = None):
        w = dict(WEIGHTED_DEFAULTS)
        w.update(weights or {})
        unknown = set(w) - set(WEIGHTED_DEFAULTS)
        if unknown:
            raise ValueError(f"weights: unknown scorer(s) {sorted(unknown)}; known: {sorted(WEIGHTED_DEFAULTS)}")
        if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
            raise ValueError(f"weights: must be >= 0 with a positive sum, got {w}")
        total = sum(w.values())
        self.weights = {k: v / total for k, v in w.items()}

    def scores(self, backends, f, now: float) -> list[float]:
        qs = [b.inflight for b in backends]
        lo, hi = min(qs), max(qs)
        w = self.weights
        out = []
        for b in backends:
            queue = 1.0 if hi == lo else (hi - b.inflight) / (hi - lo)
            out.append(w["affinity"] * (1.0 if b.holds(f.template_key, now) else 0.0) + w["queue"] * queue
                       + w["utilisation"] * (1.0 - b.utilisation()))
        return out

    def choose(self, backends, f, now=None):
        now = time.monotonic() if now is None else now
        s = self.scores(backends, f, now)
        best = max(range(len(backends)), key=lambda i: (s[i], -backends[i].inflight, backends[i].name))
        return backends[best]


class PredictedLatency(Policy):
    """Lowest predicted completion latency (module docstring), with tier and checkpoint residency, deadline slack and
    the extra work a placement costs the cluster.

    Greedy per-request latency spends capacity: a request sent past its template's or checkpoint's backend to a
    shorter queue finishes sooner itself, but computes the full model (or loads a checkpoint, evicting another)
    where a cached run would have done, and that extra work delays the requests that share the backend with it. A
    placement on backend ``b`` is scored ``latency + beta_b * (its work - the request's least work on any
    backend)``, ``beta_b`` = ``congestion_weight`` x ``b``'s requests in flight (at least ``min_work_weight``): the
    busier the backend, the more requests the extra work delays, while an idle backend's spare capacity costs
    little. This replaces the former hot-spot guard (``abs_gate_ms`` / ``rel_gate``, off by default): load still
    beats affinity once the affine backend's queue outgrows the extra work, and the guard, which overrode the score
    whenever one backlog passed twice another, spread templates and checkpoints under load (more misses and loads:
    capacity lost when it is shortest). A request with a deadline takes, among the backends predicted to meet it
    with a margin (``deadline_margin`` x its deadline: the prediction leaves out the requests routed after it that
    will share its batches), the one where it costs the least work; if none meets it, the rule above."""

    name = "predicted"

    def __init__(self, estimator: Estimator, abs_gate_ms: float | None = None, rel_gate: float = 2.0,
                 use_slack: bool = True, congestion_weight: float = 2.0, min_work_weight: float = 1.0,
                 deadline_margin: float = 0.6):
        self.est, self.abs_gate_ms, self.rel_gate, self.use_slack = estimator, abs_gate_ms, rel_gate, use_slack
        self.congestion_weight, self.min_work_weight = congestion_weight, min_work_weight
        self.deadline_margin = deadline_margin

    def score(self, b: BackendLoad, f: EditFeatures, now: float) -> float:
        """Predicted completion latency (ms) of ``f`` on ``b``."""
        return b.backlog_at(now) + self.est.cost_ms(f, b, now)

    def choose(self, backends, f, now=None):
        if self.est.stale:  # the cost model is off: a score that does not use it
            return LeastMaskedTokens().choose(backends, f)
        now = time.monotonic() if now is None else now
        hit, miss = self.est.request_ms(f, True), self.est.request_ms(f, False)  # once, not per backend
        rows = []
        for b in backends:
            own = self.est.cost_ms(f, b, now, hit, miss)
            backlog = b.backlog_at(now)
            # (latency, work: its own and the reload its checkpoint's eviction causes, not holding the template
            # (on equal scores the backend holding it wins: its entry stays in use), requests, name, backlog)
            rows.append((backlog + own, own + self.est.eviction_ms(f, b), not b.holds(f.template_key, now),
                         b.inflight, b.name, backlog, b))
        best = None
        if self.use_slack and f.deadline_s is not None:
            meets = [r for r in rows if r[0] <= self.deadline_margin * f.deadline_s * 1000.0]
            if meets:  # slack: the cheapest placement that still meets the deadline saves capacity for the rest
                best = min(meets, key=lambda r: (r[1], r[0], r[4]))
        if best is None:
            least_work = min(r[1] for r in rows)
            best = min(rows, key=lambda r: (r[0] + max(self.min_work_weight, self.congestion_weight * r[3]) *
                                            (r[1] - least_work),) + r[2:5])
        if self.abs_gate_ms is not None:  # the former hot-spot guard, when asked for
            least = min(rows, key=lambda r: (r[5], r[3], r[4]))
            if best is not least and best[5] - least[5] > self.abs_gate_ms and \
                    best[5] > self.rel_gate * max(least[5], 1.0):
                return least[-1]
        return best[-1]


POLICIES = ("predicted", "chwbl", "p2c", "weighted", "round_robin", "least_requests", "least_masked_tokens")


def parse_weights(text: str | None) -> dict:
    """``affinity=3,queue=2,utilisation=2`` -> dict (a setting of the ``weighted`` policy)."""
    out = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        k, _, v = part.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise ValueError(f"weights: {part!r} is not name=number") from None
    return out


def make(name: str, estimator: Estimator, *, load_factor: float = 1.25, vnodes: int = 100,
         weights: dict | None = None, seed: int | None = None, use_slack: bool = True,
         predicted: dict | None = None) -> Policy:
    """``predicted``: keyword settings of ``PredictedLatency`` (``congestion_weight``, ``deadline_margin``, ...)."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown {name!r}; known: {', '.join(POLICIES)}")
    return {"round_robin": RoundRobin, "least_requests": LeastRequests,
            "least_masked_tokens": LeastMaskedTokens,
            "chwbl": lambda: ConsistentHashBoundedLoads(load_factor, vnodes),
            "p2c": lambda: PowerOfTwoChoices(seed),
            "weighted": lambda: WeightedScorers(weights),
            "predicted": lambda: PredictedLatency(estimator, use_slack=use_slack, **(predicted or {}))}[name]()
