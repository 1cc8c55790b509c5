"""Which mode each block of a hit runs in: the policy a cache runtime is given.

Serving plans with InstGenIE's Algorithm 1 over the profiled cost model (``planner``: full / Y / KV per block;
``planner_y``: full / Y). A policy only decides; it never touches tensors. The benchmarks' fixed baselines (every
recorded block in Y, in KV, or without the unmasked context) are ``BlockPolicy`` subclasses in the lab
(``maskedit_lab.harness.baselines.FixedPolicy``), handed to a ``CacheRuntime`` like any policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from maskedit_common.cost_model import CostModel

from .modes import FULL, KV, NOCTX, Y
from .planner import MODES, plan

POLICIES = ("off", "planner", "planner_y")  # the values of MASKEDIT_CACHE


@dataclass(frozen=True)
class PlanInput:
    """What a plan depends on: the blocks' kinds, the request's token counts, the entry's recorded rows."""

    kinds: list[str]  # per block: "dual" / "single" (Flux), "unet-l<level>" (SD 2 / SDXL)
    n: int  # image tokens
    c: int  # image tokens computed (masked plus the entry's invalid ones)
    text: int  # text tokens
    dim: int
    itemsize: int  # bytes per element of the rows (the model's dtype)
    has_y: list[bool]  # per block: output rows recorded
    has_kv: list[bool]  # per block: keys/values recorded
    # Blocks of different sizes (a UNet's levels): per block (tokens, computed tokens, width); None: all alike.
    blocks: list[tuple[int, int, int]] | None = None


@dataclass(frozen=True)
class BlockPolicy:
    """The planner over ``MODES`` (``planner``) or over full / Y (``planner_y``), predicting with ``cost``."""

    name: str
    cost: CostModel | None = None

    @property
    def heals(self) -> bool:
        """Does a hit under this policy compute template context (so its rows may heal the entry)?"""
        return True

    def plan(self, p: PlanInput) -> tuple[list[str], float | None]:
        """Modes per block, and the predicted latency when a cost model decided."""
        if p.blocks is not None:
            costs = [self.cost.block_costs([k], n, c, p.text, d, n * d * p.itemsize, 2 * n * d * p.itemsize,
                                            [hy], [hk])[0]
                     for k, (n, c, d), hy, hk in zip(p.kinds, p.blocks, p.has_y, p.has_kv)]
        else:
            row_bytes = p.n * p.dim * p.itemsize
            costs = self.cost.block_costs(p.kinds, p.n, p.c, p.text, p.dim, row_bytes, 2 * row_bytes, p.has_y,
                                          p.has_kv)
        r = plan(costs, MODES if self.name == "planner" else (FULL, Y))
        return list(r.modes), r.latency_ms


def make_policy(name: str, cost: CostModel | None = None) -> BlockPolicy:
    if name not in POLICIES or name == "off":
        raise ValueError(f"cache policy must be one of {POLICIES}")
    return BlockPolicy(name, cost or CostModel.fallback())


def needs_output(modes: list[str]) -> list[bool]:
    """Per block: must the hit's cached output rows be written into the block's output? Y/noctx blocks always;
    a KV block only when the next block reads its unmasked rows (full / Y / noctx) or it is the last one."""
    out = []
    for b, m in enumerate(modes):
        nxt = modes[b + 1] if b + 1 < len(modes) else None
        out.append(m in (Y, NOCTX) or (m == KV and (nxt is None or nxt in (FULL, Y, NOCTX))))
    return out
