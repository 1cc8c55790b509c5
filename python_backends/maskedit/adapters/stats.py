"""What the adapter cache tiers of one process did, for its Prometheus metrics (``maskedit.triton.adapter_metrics``)
and tests: hits and misses per tier, evictions, corrupt host entries, storage errors, and each load's time by the
tier it came from (``host``: a converted copy read from the shared host cache; ``library``: the adapter file read and
converted). Plain counters under one lock; the metrics side reads them and drains the load times."""

from __future__ import annotations

import threading
from collections import Counter, deque

TIERS = ("device", "host")
EVENTS = ("hit", "miss", "eviction", "corrupt", "error", "failed")
SOURCES = ("host", "library")


class AdapterStats:
    def __init__(self):
        self.counts: Counter = Counter()  # (tier, event) -> n
        self.load_s: Counter = Counter()  # source -> seconds summed
        self._loads: deque = deque(maxlen=10_000)  # (source, seconds) not yet drained by the metrics
        self._mu = threading.Lock()

    def count(self, tier: str, event: str, n: int = 1) -> None:
        with self._mu:
            self.counts[(tier, event)] += n

    def loaded(self, source: str, seconds: float) -> None:
        with self._mu:
            self.load_s[source] += seconds
            self.counts[(source, "load")] += 1
            self._loads.append((source, seconds))

    def get(self, tier: str, event: str) -> int:
        with self._mu:
            return self.counts[(tier, event)]

    def drain_loads(self) -> list[tuple[str, float]]:
        with self._mu:
            out = list(self._loads)
            self._loads.clear()
        return out

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._mu:
            return dict(self.counts)
