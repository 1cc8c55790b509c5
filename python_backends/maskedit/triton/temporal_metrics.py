"""Triton custom metrics of temporal reuse (``maskedit.temporal``): steps and block evaluations computed or reused,
per policy, counted from each finished request's EDIT_INFO. Steps are the prompt's call's (``temporal_steps``); block
evaluations also count the negative prompt's call of a guided request (``temporal_uncond_steps``)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils


class TemporalMetrics:
    def __init__(self):
        self.steps = pb_utils.MetricFamily(
            name="maskedit_temporal_steps_total", description="denoise steps of requests with a temporal reuse "
            "policy: computed, or reused (their middle blocks skipped)", kind=pb_utils.MetricFamily.COUNTER)
        self.blocks = pb_utils.MetricFamily(
            name="maskedit_temporal_blocks_total", description="transformer block evaluations of those requests: "
            "computed or skipped", kind=pb_utils.MetricFamily.COUNTER)
        self._metrics: dict = {}

    def _metric(self, family, labels: dict):
        key = (id(family), tuple(sorted(labels.items())))
        if key not in self._metrics:
            self._metrics[key] = family.Metric(labels=labels)
        return self._metrics[key]

    def observe(self, info: dict) -> None:
        steps = info.get("temporal_steps")
        if not steps:
            return
        policy = (info.get("temporal") or {}).get("policy", "off")
        reused = steps.count("R")
        computed = len(steps) - reused
        blocks = info.get("temporal_blocks") or {}
        n, kept = int(blocks.get("of", 0)), int(blocks.get("first", 0)) + int(blocks.get("last", 0))
        for outcome, k in (("computed", computed), ("reused", reused)):
            if k:
                self._metric(self.steps, {"policy": policy, "outcome": outcome}).increment(k)
        uncond = info.get("temporal_uncond_steps") or ""  # the negative prompt's call, its own stream
        u_reused = uncond.count("R")
        computed, reused = computed + len(uncond) - u_reused, reused + u_reused  # calls, from here on
        if n:
            for outcome, k in (("computed", computed * n + reused * kept), ("skipped", reused * (n - kept))):
                if k:
                    self._metric(self.blocks, {"policy": policy, "outcome": outcome}).increment(k)
