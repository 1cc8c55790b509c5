"""Activation-cache wiring inside the Triton processes: store, runtime and Triton custom metrics.

``Settings.cache`` (``MASKEDIT_CACHE``: the policy, ``planner`` by default, ``off`` disables caching; the store's
directories and sizes from ``MASKEDIT_CACHE_*``) is the same in every model process, so they share one store.
"""

from __future__ import annotations

import logging
import threading

import triton_python_backend_utils as pb_utils

from maskedit_common.settings import CacheSettings

from ..cache.cost_model import CostModel, device_slug
from ..cache.runtime import CacheRuntime
from ..cache.store import from_settings
from ..components import family
from ..settings import Settings
from . import periodic


def cache_store(cache: CacheSettings, log: logging.Logger):
    if not cache.enabled:
        return None
    try:
        return from_settings(cache)
    except OSError as e:  # no usable shared memory: serve without the cache rather than not at all
        log.warning("activation store unavailable (%s); caching off", e)
        return None


def cost_model(settings: Settings, log: logging.Logger) -> CostModel:
    """The profile measured for this model on this hardware (a GPU's own: its planner choices differ from a
    CPU's) in the profiles directory, or ``MASKEDIT_COST_PROFILE`` (``Settings.cost_profile_for``)."""
    path = settings.cost_profile_for(device_slug(settings.torch_device))
    try:
        model = CostModel.load_file(path)
        log.info("cost model from %s", path)
        return model
    except (OSError, ValueError, KeyError):
        log.info("no cost profile at %s (run maskedit-calibrate); using the FLOP fallback", path)
        return CostModel.fallback()


def cache_runtime(transformer, settings: Settings, log: logging.Logger) -> CacheRuntime | None:
    store = cache_store(settings.cache, log)
    if store is None:
        return None
    return CacheRuntime(family(settings).cache_hooks(transformer), store, cost_model(settings, log),
                        policy=settings.cache.policy, budget_bytes=settings.cache.budget_bytes,
                        lora_base_reuse=settings.cache.lora_base_reuse)


class CacheMetrics:
    """Triton custom metrics (served on the metrics port): cache outcomes, store bytes per tier, and how
    denoise requests ended (OK, CANCELLED, DEADLINE_EXCEEDED, ...)."""

    def __init__(self, store):
        self.store = store
        self.requests = pb_utils.MetricFamily(
            name="maskedit_cache_requests_total", description="denoise requests by activation-cache outcome",
            kind=pb_utils.MetricFamily.COUNTER)
        self.events = pb_utils.MetricFamily(
            name="maskedit_cache_events_total", description="activation store events in this process",
            kind=pb_utils.MetricFamily.COUNTER)
        self.bytes = pb_utils.MetricFamily(
            name="maskedit_cache_bytes", description="activation store bytes per tier",
            kind=pb_utils.MetricFamily.GAUGE)
        self._req = {k: self.requests.Metric(labels={"outcome": k}) for k in ("hit", "record", "off", "full")}
        self._ev = {k: self.events.Metric(labels={"event": k})
                    for k in ("hits", "misses", "evictions", "promotions", "corrupt", "inserts", "heals", "dropped",
                              "refused", "errors")}
        self._bytes = {t: self.bytes.Metric(labels={"tier": t}) for t in ("mem", "disk")}
        self.degraded = pb_utils.MetricFamily(
            name="maskedit_cache_tier_degraded", description="1 while a store tier fails to write, delete or make "
            "room (the store keeps its budgets by dropping or refusing entries meanwhile)",
            kind=pb_utils.MetricFamily.GAUGE)
        self._degraded = {t: self.degraded.Metric(labels={"tier": t}) for t in ("mem", "disk")}
        # A family must outlive its metrics (Triton deletes a metric's values with its family).
        self.budget_family = pb_utils.MetricFamily(
            name="maskedit_cache_mem_budget_bytes", description="the memory tier's budget now (shrunk to what its "
            "filesystem holds)", kind=pb_utils.MetricFamily.GAUGE)
        self.budget = self.budget_family.Metric(labels={})
        self.write_cpu = pb_utils.MetricFamily(
            name="maskedit_cache_write_cpu_seconds_total",
            description="CPU seconds of background activation writes (a template run's entry, a heal)",
            kind=pb_utils.MetricFamily.COUNTER)
        self._cpu = {k: self.write_cpu.Metric(labels={"kind": k}) for k in ("record", "heal")}
        self._seen = {k: 0 for k in self._ev} | {f"{k}_cpu_s": 0.0 for k in self._cpu}
        self.outcomes = pb_utils.MetricFamily(
            name="maskedit_denoise_requests_total", description="denoise requests by how they ended",
            kind=pb_utils.MetricFamily.COUNTER)
        self._out = {}
        self._sync_lock = threading.Lock()

    def outcome(self, code: str) -> None:
        if code not in self._out:
            self._out[code] = self.outcomes.Metric(labels={"code": code})
        self._out[code].increment(1)

    def observe(self, info: dict) -> None:
        outcome = info.get("cache", "off")
        if outcome in self._req:
            self._req[outcome].increment(1)
        self.sync()

    def sync(self) -> None:
        """Bring the store's event counters up to date. Called when any request ends, failed ones included (a
        request that looked its entry up and was then cancelled must still show its lookup), and every few
        seconds (a template run's entry is written after its answer: its insert used to show only when the next
        request ended, so the counters disagreed by one while the server was idle)."""
        if self.store is None:
            return
        with self._sync_lock:
            self._sync()

    def sync_every(self, interval_s: float = 5.0) -> threading.Event:
        return periodic.every(self.sync, interval_s, "cache-metrics")

    def _sync(self) -> None:
        m = self.store.metrics()
        counters = list(self._ev.items()) + [(f"{k}_cpu_s", c) for k, c in self._cpu.items()]
        for k, metric in counters:
            delta = m[k] - self._seen[k]
            if delta > 0:
                metric.increment(delta)
                self._seen[k] = m[k]
        self._bytes["mem"].set(m["mem_bytes"])
        self._bytes["disk"].set(m["disk_bytes"])
        for t, metric in self._degraded.items():
            metric.set(1 if m["degraded"].get(t) else 0)
        self.budget.set(m["mem_budget"])
