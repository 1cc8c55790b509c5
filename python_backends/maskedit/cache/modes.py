"""The modes a block runs in for one request, and the step context the masked-block hooks read: shared by every
family's hooks and the cache runtime.

- ``full``: the block's own forward on every token;
- ``y``: computed tokens only; keys/values of cached tokens projected from their cached input rows; output rows of
  cached tokens from the store;
- ``kv``: as ``y`` but keys/values of cached tokens come from the store;
- ``noctx``: computed tokens attend only to themselves and the text (a fidelity lower bound for benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

FULL, Y, KV, NOCTX = "full", "y", "kv", "noctx"


@dataclass
class StepContext:
    rows: list  # per batch row: a family's row view, or None (plain full compute)
    packed: bool = False  # rows of different resolutions padded to one length: every row takes the gathered path
    on_block: Callable[[int], None] | None = None  # told as each block starts (the loader's look-ahead window)
    controls: Any = None  # the requests' cached ControlNets (``cache.controlnet.ControlNetCaches``), if any
    temporal: Any = None  # the call's temporal reuse (``maskedit.temporal.TemporalCall``), if any row reuses

    def skipped(self, b: int) -> list[int]:
        """Batch rows passing block ``b`` through unchanged (temporal reuse of a middle block)."""
        return self.temporal.skipped(b) if self.temporal is not None else []


_INDEX: dict = {}


def index(rows: list[int], device) -> torch.Tensor:
    """Batch-row indices as a device tensor, made once per (rows, device): building one from a list in the hot path
    would be a host-to-device copy from pageable memory at every block, which can stall the host on a GPU."""
    key = (tuple(rows), str(device))
    t = _INDEX.get(key)
    if t is None:
        t = _INDEX[key] = torch.tensor(rows, device=device)
    return t
