"""Triton custom metrics of the adapter cache (served on the metrics port), from one process's ``AdapterStats``:

Denoise processes export them as ``maskedit_lora_*``, pre-processing (its prefetches into the host tier) as
``maskedit_lora_prefetch_*`` (one family name per model: Triton does not share a family between model processes):

- ``maskedit_lora_load_seconds`` (histogram, ``source``: ``host`` a converted copy read from the host tier,
  ``library`` the file read and converted): each adapter load's time;
- ``maskedit_lora_cache_total`` (counter, ``tier`` x ``event``: ``hit``, ``miss``, ``eviction``, ``corrupt``,
  ``error``, ``failed``);
- ``maskedit_lora_resident_bytes`` (gauge, ``tier``: ``device`` this process's converted adapters, ``host`` the
  shared host tier's files).

Brought up to date when a request ends and every few seconds, as the activation-cache metrics are."""

from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils

from ..adapters.stats import EVENTS, SOURCES, TIERS
from . import periodic

BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class AdapterMetrics:
    def __init__(self, stats, host=None, runtime=None, prefix: str = "maskedit_lora", tiers=TIERS):
        """``stats`` of this process's tiers; ``host``: the host tier; ``runtime``: the denoise process's
        ``AdapterRuntime`` (its device tier; None in pre-processing)."""
        self.stats, self.host, self.runtime = stats, host, runtime
        self.load_family = pb_utils.MetricFamily(
            name=f"{prefix}_load_seconds", description="adapter load time by the tier it came from (host: "
            "the shared host cache; library: the adapter file read and converted)",
            kind=pb_utils.MetricFamily.HISTOGRAM)
        self._load = {s: self.load_family.Metric(labels={"source": s}, buckets=BUCKETS) for s in SOURCES}
        self.cache_family = pb_utils.MetricFamily(
            name=f"{prefix}_cache_total", description="adapter cache events per tier (hit, miss, eviction, "
            "corrupt, error, failed)", kind=pb_utils.MetricFamily.COUNTER)
        self._events = {(t, e): self.cache_family.Metric(labels={"tier": t, "event": e})
                        for t in tiers for e in EVENTS}
        self.bytes_family = pb_utils.MetricFamily(
            name=f"{prefix}_resident_bytes", description="converted adapter bytes resident per tier",
            kind=pb_utils.MetricFamily.GAUGE)
        self._bytes = {t: self.bytes_family.Metric(labels={"tier": t}) for t in tiers}
        self._seen: dict = {}
        self._mu = threading.Lock()

    def sync(self) -> None:
        with self._mu:
            for source, seconds in self.stats.drain_loads():
                if source in self._load:
                    self._load[source].observe(seconds)
            for key, n in self.stats.snapshot().items():
                metric = self._events.get(key)
                if metric is not None and n > self._seen.get(key, 0):
                    metric.increment(n - self._seen.get(key, 0))
                    self._seen[key] = n
            if self.runtime is not None:
                self._bytes["device"].set(self.runtime.resident_bytes)
            if self.host is not None:
                self._bytes["host"].set(self.host.resident_bytes())

    def sync_every(self, interval_s: float = 5.0) -> threading.Event:
        return periodic.every(self.sync, interval_s, "lora-metrics")
