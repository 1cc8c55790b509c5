"""Routing policies. The default predicts each backend's completion latency for the new request.

Cost of sending request r to backend b, in milliseconds (InstGenIE Algorithm 2, made explicit):
    backlog(b)                         predicted remaining work of b's in-flight requests
  + compute(r)                         r's denoising at its mask ratio: cached blocks (kv) when b is likely to
                                       hold the template's activations, full blocks otherwise (a template run)
  + load(r, b)                         bringing the activations in: ~0 in host memory, disk copy otherwise
The router keeps its own account (adds predicted work when it routes, removes it on completion) and an index of
templates it routed recently per backend, so bursts of one template stay together before any report arrives.
A hot-spot guard lets load win over affinity when the preferred backend is far busier than the least loaded.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from maskedit_common.cost_model import CostModel

from .features import EditFeatures


@dataclass
class BackendLoad:
    """What the router knows about one backend."""

    name: str
    inflight: int = 0
    masked_tokens: int = 0  # sum over in-flight requests
    backlog_ms: float = 0.0  # predicted remaining work of in-flight requests
    templates: dict = field(default_factory=dict)  # template key -> expiry (monotonic seconds)
    healthy: bool = True

    def holds(self, key: str | None, now: float) -> bool:
        exp = self.templates.get(key) if key else None
        return exp is not None and exp > now


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

    def request_ms(self, f: EditFeatures, cached: bool) -> float:
        steps = f.steps or self.default_steps
        per_step = 0.0
        for kind, count, share, dim in self.blocks:
            n = max(1, int(round(share * f.tokens)))
            # (a UNet's coarser levels see a mask a little dilated; the online refit absorbs that)
            c = max(1, int(round(f.mask_ratio * n)))
            full = self.cost.block_ms(kind, "full", n, n, self.text, dim)
            # The engine's planner never runs a block from the cache slower than computing it in full: a fit
            # extrapolated past its calibrated sizes must not make a cache hit look dearer than a miss.
            per_step += count * (min(full, self.cost.block_ms(kind, "kv", n, c, self.text, dim)) if cached else full)
        return self.scale * steps * per_step

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

    @classmethod
    def add(cls, load: BackendLoad, est: Estimator, f: EditFeatures, now: float, ttl: float) -> "Booking":
        predicted = est.request_ms(f, load.holds(f.template_key, now))
        b = cls(predicted, load.backlog_ms + predicted, est.scale, int(round(f.mask_ratio * f.tokens)))
        load.inflight += 1
        load.masked_tokens += b.masked
        load.backlog_ms += predicted
        if f.template_key:  # "just routed this template here": its activations will be there
            load.templates[f.template_key] = now + ttl
        return b

    def remove(self, load: BackendLoad) -> None:
        load.inflight = max(0, load.inflight - 1)
        load.masked_tokens = max(0, load.masked_tokens - self.masked)
        load.backlog_ms = max(0.0, load.backlog_ms - self.predicted_ms)

    def observed(self, est: Estimator, observed_ms: float) -> None:
        """Refit against what the policy predicted (completion latency), not the bare service time: under load
        the latter would read queueing as slowness and inflate every backlog."""
        est.observe(self.expected_ms, observed_ms, self.scale)


class Policy:
    name = "base"

    def choose(self, backends: list[BackendLoad], f: EditFeatures) -> BackendLoad:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._n = itertools.count()

    def choose(self, backends, f):
        return backends[next(self._n) % len(backends)]


class LeastRequests(Policy):
    name = "least_requests"

    def choose(self, backends, f):
        return min(backends, key=lambda b: (b.inflight, b.name))


class LeastMaskedTokens(Policy):
    name = "least_masked_tokens"

    def choose(self, backends, f):
        return min(backends, key=lambda b: (b.masked_tokens, b.inflight, b.name))


class PredictedLatency(Policy):
    """Lowest predicted completion latency, with cache affinity and a hot-spot guard."""

    name = "predicted"

    def __init__(self, estimator: Estimator, abs_gate_ms: float = 2000.0, rel_gate: float = 2.0,
                 disk_load_ms: float = 50.0):
        self.est, self.abs_gate_ms, self.rel_gate, self.disk_load_ms = estimator, abs_gate_ms, rel_gate, disk_load_ms

    def score(self, b: BackendLoad, f: EditFeatures, now: float) -> float:
        """Predicted completion latency (ms) of ``f`` on ``b``."""
        cached = b.holds(f.template_key, now)
        return b.backlog_ms + self.est.request_ms(f, cached)

    def choose(self, backends, f):
        if self.est.stale:  # the cost model is off: a score that does not use it
            return LeastMaskedTokens().choose(backends, f)
        now = time.monotonic()
        # on equal predictions the backend holding the template wins: its cache entry stays in use
        best = min(backends, key=lambda b: (self.score(b, f, now), not b.holds(f.template_key, now), b.inflight,
                                            b.name))
        least = min(backends, key=lambda b: (b.backlog_ms, b.inflight, b.name))
        if best is not least and best.backlog_ms - least.backlog_ms > self.abs_gate_ms and \
                best.backlog_ms > self.rel_gate * max(least.backlog_ms, 1.0):
            return least  # affinity gives way to load on a hot spot
        return best


def make(name: str, estimator: Estimator) -> Policy:
    return {"round_robin": RoundRobin, "least_requests": LeastRequests,
            "least_masked_tokens": LeastMaskedTokens}.get(name, lambda: PredictedLatency(estimator))()
