"""Which blocks use the activation cache: the dynamic program of InstGenIE's Algorithm 1.

Per block there are up to three modes: ``full`` (compute every token), ``y`` (compute masked tokens; the
unmasked rows' keys/values are projected from the cached block input and their output rows come from the
cache) and ``kv`` (compute masked tokens; cached keys/values of the unmasked rows). A cached mode has to
load its rows first. One loader streams loads in block order while blocks compute in order, so

    load_end[i]  = load_end[i-1] + load_i
    done[i]      = max(done[i-1], load_end[i]) + compute_i

and the plan minimises ``done[last]``. ``kv`` blocks skip the output rows unless the next block needs them
(``full``/``y`` read the unmasked input rows, and the last block feeds the output), which couples neighbours,
so the state carries the previous mode. For each state the DP keeps the Pareto front of
(done, load_end) pairs: a pair that is later on both counts can never win, and every pair that survives
is kept, so the result is exact (tested against brute force).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from maskedit_common.blocks import FULL, KV, MODES, Y, BlockCost

# The modes and per-block costs are the cost model's vocabulary, shared with the router (``maskedit_common``).
__all__ = ["FULL", "KV", "MODES", "Y", "BlockCost", "Plan", "brute_force", "evaluate", "plan"]


@dataclass(frozen=True)
class Plan:
    modes: tuple[str, ...]
    latency_ms: float

    @property
    def cached_blocks(self) -> list[int]:
        return [i for i, m in enumerate(self.modes) if m != FULL]


def _allowed(c: BlockCost, modes: tuple[str, ...]) -> list[str]:
    out = []
    for m in modes:
        if m == FULL or (m == Y and c.load_y is not None) or (m == KV and c.load_kv is not None):
            out.append(m)
    return out


def _load(c: BlockCost, mode: str, prev_mode: str | None, prev: BlockCost | None) -> float:
    """Load time to schedule before block ``c`` runs in ``mode``."""
    t = {FULL: 0.0, Y: c.load_y or 0.0, KV: c.load_kv or 0.0}[mode]
    if prev_mode == KV and mode in (FULL, Y):
        t += prev.load_y  # the previous kv block's output rows are this block's input rows
    return t


def _feasible(prev_mode: str | None, prev: BlockCost | None, mode: str) -> bool:
    return not (prev_mode == KV and mode in (FULL, Y) and prev.load_y is None)


def evaluate(costs: list[BlockCost], modes: tuple[str, ...]) -> float:
    """Latency of one given plan under the pipeline model (inf if infeasible)."""
    done = load_end = 0.0
    prev_mode, prev = None, None
    for c, m in zip(costs, modes):
        if m not in _allowed(c, MODES) or not _feasible(prev_mode, prev, m):
            return float("inf")
        load_end += _load(c, m, prev_mode, prev)
        done = max(done, load_end) + c.compute(m)
        prev_mode, prev = m, c
    if prev_mode == KV:  # the output projection reads every row of the last block
        if prev.load_y is None:
            return float("inf")
        load_end += prev.load_y
        done = max(done, load_end)
    return done


def plan(costs: list[BlockCost], modes: tuple[str, ...] = MODES) -> Plan:
    """The latency-minimal assignment of ``modes`` to blocks."""
    # state: prev_mode -> list of (done, load_end, modes) on the Pareto front
    fronts: dict[str | None, list[tuple[float, float, tuple[str, ...]]]] = {None: [(0.0, 0.0, ())]}
    prev: BlockCost | None = None
    for c in costs:
        nxt: dict[str, list] = {}
        for prev_mode, front in fronts.items():
            for m in _allowed(c, modes):
                if not _feasible(prev_mode, prev, m):
                    continue
                for done, load_end, chosen in front:
                    le = load_end + _load(c, m, prev_mode, prev)
                    nxt.setdefault(m, []).append((max(done, le) + c.compute(m), le, chosen + (m,)))
        fronts = {m: _pareto(f) for m, f in nxt.items()}
        prev = c
    best: Plan | None = None
    for m, front in fronts.items():
        for done, load_end, chosen in front:
            if m == KV:
                if prev.load_y is None:
                    continue
                done = max(done, load_end + prev.load_y)
            if best is None or done < best.latency_ms - 1e-12:
                best = Plan(chosen, done)
    if best is None:  # cannot happen while FULL is allowed
        raise ValueError("no feasible plan")
    return best


def _pareto(points: list[tuple[float, float, tuple]]) -> list[tuple[float, float, tuple]]:
    points.sort(key=lambda p: (p[0], p[1]))
    out, best_load = [], float("inf")
    for p in points:
        if p[1] < best_load - 1e-12:
            out.append(p)
            best_load = p[1]
    return out


def brute_force(costs: list[BlockCost], modes: tuple[str, ...] = MODES) -> Plan:
    """Every assignment; for tests."""
    best = None
    for chosen in itertools.product(modes, repeat=len(costs)):
        t = evaluate(costs, chosen)
        if best is None or t < best.latency_ms - 1e-12:
            best = Plan(tuple(chosen), t)
    return best
