"""The vocabulary the planner, the cost model and the router share: a block's cache modes and its predicted
costs at one request's mask ratio.

``full`` computes every token; ``y`` computes the masked tokens and projects the unmasked rows' keys/values from
the cached block input, taking their output rows from the cache; ``kv`` computes the masked tokens against cached
keys/values of the unmasked rows.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, Y, KV = "full", "y", "kv"
MODES = (FULL, Y, KV)


@dataclass(frozen=True)
class BlockCost:
    """Predicted milliseconds for one block of one request at its mask ratio.

    ``load_y``/``load_kv`` are None when that mode's rows were not recorded (budget) for this block.
    ``load_y`` is also the price of the output rows a ``kv`` block must load when the next block needs them.
    """

    compute_full: float
    compute_y: float
    compute_kv: float
    load_y: float | None
    load_kv: float | None

    def compute(self, mode: str) -> float:
        return {FULL: self.compute_full, Y: self.compute_y, KV: self.compute_kv}[mode]
