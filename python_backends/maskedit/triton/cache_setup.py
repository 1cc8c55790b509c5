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


def keep_recovering(store, cache: CacheSettings) -> threading.Event | None:
    """The store's recovery probe every ``cache.probe_s`` in this process (``ActivationStore.probe``: a budget shrunk
    by a full filesystem grows back, a degraded tier clears once it takes a write); set the event to stop it."""
    if store is None:
        return None
    return periodic.every(store.probe, cache.probe_s, "cache-probe")


STORE_EVENTS = ("hits", "misses", "evictions", "promotions", "corrupt", "inserts", "heals", "dropped", "refused",
                "errors", "recovered")


class StoreMetrics:
    """What one model process's view of the shared stores says, labelled with the process's model (each process has
    its own counters and its own view of a tier's health; a reloaded model's series starts again from 0 as any
    restarted process's):

    - ``maskedit_cache_events_total{store, model, event}``: the activation store's events in this process
      (``store="activations"``), and the adapter host tier's corrupt entries (``store="adapters"``) — so
      ``sum(maskedit_cache_events_total{event="corrupt"})`` counts every corrupt entry any process found;
    - ``maskedit_cache_tier_degraded{tier, model}``: 1 while this process sees a tier failing;
    - ``maskedit_cache_mem_budget_bytes{model}``: its memory-tier budget now (shrunk after ENOSPC, grown back by
      the probe).

    Triton shares a metric family between the model processes of one server (and a series with the same labels),
    hence the ``model`` label on every series."""

    def __init__(self, store, model: str, adapter_stats=None):
        self.store, self.adapter_stats = store, adapter_stats
        self.events = pb_utils.MetricFamily(
            name="maskedit_cache_events_total", description="activation store events by process (model), and "
            "corrupt adapter cache entries (store=adapters)", kind=pb_utils.MetricFamily.COUNTER)
        labels = {"store": "activations", "model": model}
        self._ev = {k: self.events.Metric(labels={**labels, "event": k}) for k in STORE_EVENTS} \
            if store is not None else {}
        self._adapter_corrupt = self.events.Metric(labels={"store": "adapters", "model": model, "event": "corrupt"}) \
            if adapter_stats is not None else None
        # A family must outlive its metrics (Triton deletes a metric's values with its family).
        self.degraded = pb_utils.MetricFamily(
            name="maskedit_cache_tier_degraded", description="1 while a store tier fails to write, delete or make "
            "room, or its memory budget is shrunk (the store keeps its budgets by dropping or refusing entries "
            "meanwhile; a probe clears it once the fault is gone)", kind=pb_utils.MetricFamily.GAUGE)
        self.budget_family = pb_utils.MetricFamily(
            name="maskedit_cache_mem_budget_bytes", description="the memory tier's budget now (shrunk to what its "
            "filesystem holds after ENOSPC, grown back when the space returns)", kind=pb_utils.MetricFamily.GAUGE)
        self._degraded, self.budget = {}, None
        if store is not None:
            self._degraded = {t: self.degraded.Metric(labels={"tier": t, "model": model}) for t in ("mem", "disk")}
            self.budget = self.budget_family.Metric(labels={"model": model})
        self._seen: dict = {}
        self._mu = threading.Lock()

    def _add(self, key, metric, total) -> None:
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            metric.increment(delta)
            self._seen[key] = total

    def sync(self, m: dict | None = None) -> None:
        """Bring the counters and gauges up to date (``m``: the store's ``metrics()`` when the caller has them)."""
        with self._mu:
            if self.store is not None:
                m = m or self.store.metrics()
                for k, metric in self._ev.items():
                    self._add(k, metric, m[k])
                for t, metric in self._degraded.items():
                    metric.set(1 if m["degraded"].get(t) else 0)
                self.budget.set(m["mem_budget"])
            if self._adapter_corrupt is not None:
                self._add("adapters", self._adapter_corrupt, self.adapter_stats.get("host", "corrupt"))

    def sync_every(self, interval_s: float = 5.0) -> threading.Event:
        return periodic.every(self.sync, interval_s, "store-metrics")


class CacheMetrics:
    """Triton custom metrics of the denoise process (served on the metrics port): cache outcomes, store bytes per
    tier, background write CPU, how denoise requests ended (OK, CANCELLED, DEADLINE_EXCEEDED, ...), and its
    ``StoreMetrics``."""

    def __init__(self, store, adapter_stats=None, model: str = "masked_denoise"):
        self.store = store
        self.store_metrics = StoreMetrics(store, model, adapter_stats)
        self.requests = pb_utils.MetricFamily(
            name="maskedit_cache_requests_total", description="denoise requests by activation-cache outcome",
            kind=pb_utils.MetricFamily.COUNTER)
        self.bytes = pb_utils.MetricFamily(
            name="maskedit_cache_bytes", description="activation store bytes per tier",
            kind=pb_utils.MetricFamily.GAUGE)
        self._req = {k: self.requests.Metric(labels={"outcome": k}) for k in ("hit", "record", "off", "full")}
        self._bytes = {t: self.bytes.Metric(labels={"tier": t}) for t in ("mem", "disk")}
        self.write_cpu = pb_utils.MetricFamily(
            name="maskedit_cache_write_cpu_seconds_total",
            description="CPU seconds of background activation writes (a template run's entry, a heal)",
            kind=pb_utils.MetricFamily.COUNTER)
        self._cpu = {k: self.write_cpu.Metric(labels={"kind": k}) for k in ("record", "heal")}
        self._seen = {f"{k}_cpu_s": 0.0 for k in self._cpu}
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
            self.store_metrics.sync()
            return
        with self._sync_lock:
            self._sync()

    def sync_every(self, interval_s: float = 5.0) -> threading.Event:
        return periodic.every(self.sync, interval_s, "cache-metrics")

    def _sync(self) -> None:
        m = self.store.metrics()
        self.store_metrics.sync(m)
        for k, c in self._cpu.items():
            delta = m[f"{k}_cpu_s"] - self._seen[f"{k}_cpu_s"]
            if delta > 0:
                c.increment(delta)
                self._seen[f"{k}_cpu_s"] = m[f"{k}_cpu_s"]
        self._bytes["mem"].set(m["mem_bytes"])
        self._bytes["disk"].set(m["disk_bytes"])
