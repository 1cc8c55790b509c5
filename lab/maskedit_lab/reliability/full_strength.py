"""Whether the system is back to full strength after a fault, not only serving: every backend in the router's
rotation, every model process's view of the activation store healthy (no tier flagged degraded, the memory budget
back to its configured size), and the cache hit rate back to what it was before the fault. ``make faults`` measures
``recovery_s`` as the time until all of that holds."""

from __future__ import annotations

import re
import time
import urllib.request

import numpy as np

from .topology import Topology


def store_view(topo: Topology, i: int) -> dict | None:
    """Backend ``i``'s activation store as its model processes export it (None when its metrics do not answer):
    ``events`` summed over processes, ``degraded`` per tier (any process), ``budgets`` per process (model)."""
    port = topo.servers[i].metrics_port
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    out: dict = {"events": {}, "degraded": {}, "budgets": {}}
    for m in re.finditer(r'^maskedit_cache_events_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out["events"][labels.get("event")] = out["events"].get(labels.get("event"), 0) + float(m.group(2))
    for m in re.finditer(r'^maskedit_cache_tier_degraded\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        tier = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).get("tier")
        out["degraded"][tier] = max(out["degraded"].get(tier, 0), float(m.group(2)))
    for m in re.finditer(r'^maskedit_cache_mem_budget_bytes\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        model = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).get("model", "?")
        out["budgets"][model] = float(m.group(2))
    return out


def weak_spots(topo: Topology) -> list[str]:
    """What keeps the system below full strength now (empty: full strength), by what the parts export."""
    out = []
    h = topo.health()
    if not h:
        out.append("router not answering")
    else:
        out += [f"{b['addr']} out of rotation" for b in h["backends"] if not b.get("in_rotation")]
    for i, s in enumerate(topo.servers):
        view = store_view(topo, i)
        if view is None:
            out.append(f"server{i} metrics not answering")
            continue
        out += [f"server{i} {t} tier degraded" for t, v in view["degraded"].items() if v]
        configured = s.settings.cache.mem_bytes
        out += [f"server{i}/{m} memory budget {b / 2**20:.1f} of {configured / 2**20:.1f} MiB"
                for m, b in view["budgets"].items() if b < configured]
    return out


def await_full_strength(topo: Topology, timeout_s: float = 120.0, every_s: float = 0.25) -> tuple[float | None, list]:
    """Seconds until ``weak_spots`` is empty (None if it never was within ``timeout_s``), and what was weak last."""
    t0 = time.perf_counter()
    weak: list = []
    while time.perf_counter() - t0 < timeout_s:
        weak = weak_spots(topo)
        if not weak:
            return time.perf_counter() - t0, []
        time.sleep(every_s)
    return None, weak


def hit_rate(records, lo: float, hi: float = float("inf")) -> float | None:
    """Cache hits among the answered requests sent in [lo, hi) (seconds from the load's start)."""
    got = [bool(r.cache_hit) for r in records if r.error is None and r.done_s is not None and lo <= r.submit_s < hi]
    return round(float(np.mean(got)), 3) if got else None


def hit_rate_back_at(records, since: float, target: float, window: int = 10) -> float | None:
    """The load-clock time (seconds from its start) at which the hit rate was back: the answer time of the first
    hit of the first ``window`` requests in a row (in order sent, sent after ``since``) whose hit rate is at least
    ``target``. None: never. (A first sporadic hit is not the cache back.)"""
    recs = sorted((r for r in records if r.error is None and r.done_s is not None and r.submit_s >= since),
                  key=lambda r: r.submit_s)
    for k in range(max(0, len(recs) - window + 1)):
        win = recs[k:k + window]
        if np.mean([bool(r.cache_hit) for r in win]) >= target:
            return next(r.done_s for r in win if r.cache_hit)
    return None
