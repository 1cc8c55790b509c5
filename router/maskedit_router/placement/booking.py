"""A routed request's entry in its backend's books (``books.BackendLoad``): what it added, priced by the estimator,
taken off again when it ends, and the estimator refitted on what it took."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .books import BackendLoad
from .estimator import Estimator
from .features import EditFeatures


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
        load.adapters.touch(f.adapters, now + ttl)
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
