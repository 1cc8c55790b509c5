"""Which tiers of the activation store are degraded by storage errors now, logged once per kind of error.

A tier that fails to write, delete, copy or make room is degraded until it next succeeds at that kind of work.
Each kind's first failure is logged (structured, with its context) and every one is counted; repeats are not
logged again until the tier has recovered, so an unwritable disk does not flood the log from every eviction.
"""

from __future__ import annotations

import logging
import threading

from .. import logs

log = logging.getLogger("maskedit.cache.store")


class TierHealth:
    def __init__(self, stats):
        """``stats``: the store's ``StoreStats`` (its ``errors`` counts every failure)."""
        self.stats = stats
        self.degraded: dict[str, str | None] = {"mem": None, "disk": None}  # tier -> the error degrading it
        self._failing: set[tuple[str, str]] = set()  # (tier, kind of work) failing now
        self._mu = threading.Lock()

    def failed(self, tier: str, op: str, e: BaseException, **context) -> None:
        self.stats.errors += 1
        with self._mu:
            self.degraded[tier] = f"{op}: {type(e).__name__}: {getattr(e, 'strerror', None) or e}"
            first = (tier, op) not in self._failing
            self._failing.add((tier, op))
        if first:
            logs.event(log, "activation store tier degraded", logging.WARNING, tier=tier, op=op,
                       error=type(e).__name__, errno=getattr(e, "errno", None), detail=str(e)[:200], **context)

    def ok(self, tier: str, op: str) -> None:
        with self._mu:
            if (tier, op) not in self._failing:
                return
            self._failing.discard((tier, op))
            if any(t == tier for t, _ in self._failing):
                return
            self.degraded[tier] = None
        logs.event(log, "activation store tier recovered", tier=tier, op=op)
