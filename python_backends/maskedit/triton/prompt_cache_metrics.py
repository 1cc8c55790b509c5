"""Triton custom metrics of pre-processing's cache of encoded prompts (``ModelFamily.prompt_cache``; families whose
prompt encoder reads the template keep one):

- ``maskedit_prompt_cache_total`` (counter, ``event``: ``hit`` the encoder skipped, ``miss`` the prompt encoded);
- ``maskedit_prompt_cache_bytes`` (gauge): the encoded prompts held.

Brought up to date after every batch of requests."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils


class PromptCacheMetrics:
    def __init__(self, cache):
        self.cache = cache
        events = pb_utils.MetricFamily(
            name="maskedit_prompt_cache_total", description="encoded-prompt cache lookups in pre-processing (hit: "
            "the prompt encoder was skipped)", kind=pb_utils.MetricFamily.COUNTER)
        self._events = {e: events.Metric(labels={"event": e}) for e in ("hit", "miss")}
        held = pb_utils.MetricFamily(name="maskedit_prompt_cache_bytes", description="encoded prompts held by "
                                     "pre-processing", kind=pb_utils.MetricFamily.GAUGE)
        self._bytes = held.Metric(labels={})
        self._families = (events, held)  # kept alive with their metrics
        self._seen = {"hit": 0, "miss": 0}

    def sync(self) -> None:
        for event, n in (("hit", self.cache.hits), ("miss", self.cache.misses)):
            if n > self._seen[event]:
                self._events[event].increment(n - self._seen[event])
                self._seen[event] = n
        self._bytes.set(self.cache.nbytes)
