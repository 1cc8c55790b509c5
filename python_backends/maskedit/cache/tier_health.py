"""Which tiers of the activation store are degraded by storage errors now, logged once per kind of error, and the
probe that clears them once the fault is gone.

A tier that fails to write, delete, copy or make room is degraded until it next succeeds at that kind of work, or
until a periodic probe (``probe_write``: a small file written, synced and removed) shows it can write again — a
tier that stopped being asked to write (its entries all dropped while the disk was read-only) would otherwise stay
flagged forever. Each kind's first failure is logged (structured, with its context) and every one is counted;
repeats are not logged again until the tier has recovered, so an unwritable disk does not flood the log from every
eviction. The memory tier's budget shrunk after ENOSPC is its own kind (``budget``): cleared only when the budget is
back to its configured size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from .. import logs
from . import tmp_files

log = logging.getLogger("maskedit.cache.store")
BUDGET = "budget"  # the kind of a shrunk memory budget: a probe write does not clear it, the budget's return does
PROBE_BYTES = 4096


def probe_write(d: Path) -> None:
    """A small file written, synced and removed in ``d`` (a hidden temporary name: never taken for an entry);
    raises ``OSError`` while the tier cannot take a write."""
    tmp = tmp_files.tmp_path(d, "probe")
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


class TierHealth:
    def __init__(self, stats):
        """``stats``: the store's ``StoreStats`` (its ``errors`` counts every failure, ``recovered`` every tier a
        probe brought back)."""
        self.stats = stats
        self.degraded: dict[str, str | None] = {"mem": None, "disk": None}  # tier -> the error degrading it
        self._failing: dict[tuple[str, str], str] = {}  # (tier, kind of work) failing now -> why
        self._mu = threading.Lock()

    def failed(self, tier: str, op: str, e: BaseException, count: bool = True, **context) -> None:
        """``count`` False: the same fault already counted under another kind (a shrink after a failed write)."""
        self.stats.errors += count
        why = f"{op}: {type(e).__name__}: {getattr(e, 'strerror', None) or e}"
        with self._mu:
            self.degraded[tier] = why
            first = (tier, op) not in self._failing
            self._failing[(tier, op)] = why
        if first:
            logs.event(log, "activation store tier degraded", logging.WARNING, tier=tier, op=op,
                       error=type(e).__name__, errno=getattr(e, "errno", None), detail=str(e)[:200], **context)

    def ok(self, tier: str, op: str, how: str = "success") -> None:
        self._clear(tier, [op], how)

    def failing(self, tier: str) -> list[str]:
        """The kinds of work ``tier`` is failing at now."""
        with self._mu:
            return [op for t, op in self._failing if t == tier]

    def probed_ok(self, tier: str) -> None:
        """A probe wrote to ``tier``: every kind of work but a shrunk budget is healthy again."""
        self._clear(tier, [op for op in self.failing(tier) if op != BUDGET], "probe")

    def _clear(self, tier: str, ops: list[str], how: str) -> None:
        with self._mu:
            cleared = [op for op in ops if self._failing.pop((tier, op), None) is not None]
            if not cleared:
                return
            left = [why for (t, _), why in self._failing.items() if t == tier]
            self.degraded[tier] = left[-1] if left else None
        if not left:
            self.stats.recovered += 1
            logs.event(log, "activation store tier recovered", tier=tier, op=",".join(cleared), how=how)
