"""Routing policies: one implementation used by the router (``--policy``), the endpoint picker (which routes through
the router) and the simulator (``maskedit_lab.routing.sim``).

The default, ``predicted``, predicts each backend's completion latency for the new request (InstGenIE Algorithm 2,
made explicit), in milliseconds:
    backlog(b, now)                    predicted remaining work of b's in-flight requests: booked work less what b
                                       has worked off since (it drains at 1 ms per ms while b is busy), so a queue of
                                       nearly finished requests is not costed as a fresh one
  + compute(r, tier)                   r's denoising at its mask ratio and steps: cached blocks (kv) when b holds the
                                       template's activations, the full model otherwise (a template run)
  + tier_load(r, tier)                 bringing the activations in: 0 from the memory tier, the profile's measured disk
                                       read of an entry from the disk tier
  + model_load(r, b)                   the base checkpoint r needs, when b does not hold it resident
  + adapter_load(r, b)                 each of r's LoRA adapters b has not recently been routed (a cold load,
                                       ``lora_load_ms`` each; ``adapter_residency``)
plus the extra work a placement costs the cluster (a template run or checkpoint load where a cached, resident
placement existed), weighted by the requests in flight on the backend it would delay (``PredictedLatency``).
A request with a deadline and slack picks, among the backends predicted to meet it (with a margin), the one where it
costs the least work (its cache entry and checkpoint are there): the capacity it saves is the other requests'
latency. The router keeps its own books (``books.py``): per backend the work it booked, a shadow of the backend's
store (a memory tier and a disk tier of the templates it routed there, LRU at the store's capacities) and of its
resident checkpoints; the costs come from ``estimator.py``.

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

from .booking import Booking  # noqa: F401 (the policies' inputs, imported from here too)
from .books import DISK, MEM, BackendLoad  # noqa: F401 (imported from here too)
from .estimator import LORA_LOAD_MS, Estimator  # noqa: F401 (imported from here too)
from .features import EditFeatures


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


WEIGHTED_DEFAULTS = {"affinity": 3.0, "queue": 2.0, "utilisation": 2.0, "adapter": 2.0}


class WeightedScorers(Policy):
    """An llm-d / GIE endpoint-picker style mix: each scorer gives every candidate a score in [0, 1] (1 best), the
    backend with the highest weighted sum wins (ties: fewer requests, then name). Scorers:
    ``affinity`` — 1 if the router's index says the backend holds the template (llm-d's prefix-cache scorer: the
    fraction of the request's cache prefix it routed there), else 0; ``queue`` — min-max normalised requests in
    flight, fewest = 1 (llm-d's queue scorer; all equal: 1); ``utilisation`` — 1 - the fill of the backend's memory
    tier (llm-d's kv-cache utilisation scorer); ``adapter`` — the fraction of the request's LoRA adapters the
    router routed there recently (1 for all when it has none: no effect; GIE's LoRA-affinity idea). Weights:
    ``WEIGHTED_DEFAULTS`` (llm-d's documented profile: prefix-cache 3, queue 2, kv-cache utilisation 2; adapter 2,
    ours), normalised to sum to 1."""

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
                       + w["utilisation"] * (1.0 - b.utilisation()) + w["adapter"] * b.adapters.share_held(
                           f.adapters, now))
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
