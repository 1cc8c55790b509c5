"""The denoise model's ControlNet metrics (Prometheus, Triton's metrics port), from the residual provider's totals
(``controlnets.provider.Stats``): steps that ran ControlNets and their wait, BLS calls to the ``controlnet`` model
and their round trips, failed calls. Per-step time is ``seconds_total / steps_total``. And each finished request's
controls by their cache status (``maskedit.cache.controlnet``: ``record``, ``hit``, ``off`` ...)."""

from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils

_METRICS = {  # stats key: (metric name, description)
    "steps": ("maskedit_controlnet_steps_total", "denoise step calls that computed ControlNet residuals"),
    "step_s": ("maskedit_controlnet_seconds_total", "seconds those steps spent on ControlNet residuals (in-process: "
               "computing them; triton: from the first BLS call's start to the last result)"),
    "calls": ("maskedit_controlnet_bls_calls_total", "BLS calls to the controlnet model (one per request and step)"),
    "bls_s": ("maskedit_controlnet_bls_seconds_total", "seconds of those BLS round trips"),
    "model_s": ("maskedit_controlnet_model_seconds_total", "of which the controlnet model's own work (the rest: BLS "
                "transfer and queueing)"),
    "failures": ("maskedit_controlnet_failures_total", "ControlNet calls that failed or timed out (their requests "
                 "failed, naming CONTROLS)"),
}


class ControlNetMetrics:
    def __init__(self, runner):
        self.runner = runner
        placement = runner.settings.controlnet_placement
        self.families = {k: pb_utils.MetricFamily(name=n, description=d, kind=pb_utils.MetricFamily.COUNTER)
                         for k, (n, d) in _METRICS.items()}  # a family must outlive its metrics
        self.metrics = {k: f.Metric(labels={"placement": placement}) for k, f in self.families.items()}
        self._seen = {k: 0 for k in _METRICS}
        self._lock = threading.Lock()
        self._cache_family = pb_utils.MetricFamily(
            name="maskedit_controlnet_cache_total", kind=pb_utils.MetricFamily.COUNTER,
            description="controls of finished requests by their ControlNet's cache status (hit: masked rows only; "
                        "record: the template run; off: computed in full)")
        self._cache = {}  # status -> metric, made on first sight
        self._placement = placement

    def observe_cache(self, statuses: list[str]) -> None:
        with self._lock:
            for st in statuses:
                m = self._cache.get(st)
                if m is None:
                    m = self._cache[st] = self._cache_family.Metric(labels={"placement": self._placement,
                                                                            "status": st})
                m.increment(1)

    def sync(self) -> None:
        provider = self.runner._control_provider  # made on the first request with controls
        if provider is None:
            return
        with self._lock:
            for k, v in provider.stats.snapshot().items():
                if v > self._seen[k]:
                    self.metrics[k].increment(v - self._seen[k])
                    self._seen[k] = v
