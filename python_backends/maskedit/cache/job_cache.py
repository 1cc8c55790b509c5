"""One request's cache state while it denoises (``JobCache``), and what a template run records of a request
(``recorded_steps``). The runtime (``runtime.CacheRuntime``) and the ControlNets' caches beside it
(``controlnet.ControlNetCaches``) both hold them."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch

from .modes import FULL, KV, NOCTX, Y


@dataclass
class JobCache:
    """One request's cache state while it denoises."""

    status: str  # off | hit | record | full (nothing cacheable)
    key: str | None = None
    entry: object = None  # a hit's rows (a store ``Entry`` or a ``LiveEntry``); a template run's own live entry
    modes: list[str] = field(default_factory=list)
    needs_output: list[bool] = field(default_factory=list)
    idx_c: torch.Tensor | None = None  # computed image tokens, on the device
    idx_u: torch.Tensor | None = None  # cached image tokens, on the device
    recorder: object = None  # a template run's recorder (the family's: ``cache.rows.Recorder`` or its own)
    valid: np.ndarray | None = None
    predicted_ms: float | None = None
    futures: dict = field(default_factory=dict)  # (step, block, kind) -> the loader's pending rows
    load_s: float = 0.0
    text_len: int = 0
    live: object = None  # following a template run in progress: its recorder
    patch: object = None  # rows of the invalid tokens this hit leaves unmasked, to heal the entry
    heal: np.ndarray | None = None  # those tokens (a UNet's: latent pixels)
    patch_pos: torch.Tensor | None = None  # their positions among idx_c (a UNet's: per level, in heal_idx)
    heal_idx: dict | None = None
    full_steps: int = 0  # steps a follower computed in full (the run had not recorded them)
    recovered: str | None = None  # the corrupt entry this request was restarted without (what was found)
    computed: np.ndarray | None = None  # UNet hits: latent pixels computed (host), and per-level indices
    level_idx: dict | None = None
    base_reuse: bool = False  # an adapter request reading the rows recorded without adapters (approximate)
    first: int = 0  # the schedule step its entry's first rows are at (STRENGTH < 1: ``recorded_steps``)

    def ready(self, step: int) -> bool:
        """Are this hit's rows for ``step`` there? Always for a stored entry; for a follower once the run has
        recorded that step."""
        return self.live is None or self.live.step > step

    def info(self) -> dict:
        cached = [i for i, m in enumerate(self.modes) if m != FULL] if self.status == "hit" else []
        return {"cache": self.status, "cache_hit": self.status == "hit", "cached_blocks": cached,
                "cache_source": ("live" if self.live is not None else "store") if self.status == "hit" else None,
                "full_steps": self.full_steps,
                "block_modes": "".join({FULL: "F", Y: "Y", KV: "K", NOCTX: "N"}[m] for m in self.modes)
                if self.status == "hit" else "",
                "computed_tokens": int(self.idx_c.numel()) if self.idx_c is not None else None,
                "healed_tokens": int(self.heal.size) if self.patch is not None and self.patch.complete else 0,
                "cache_corrupt": self.recovered is not None, "cache_base_reuse": self.base_reuse}


def recorded_steps(x):
    """``x`` as a template run records it: a STRENGTH < 1 run (``first_step`` > 0) records rows for the steps it runs
    only, and its entry says where they start (``meta["first_step"]``); later edits starting at that step or after
    read the rows at their own steps' timesteps (the schedule is the same: the stock ``get_timesteps`` takes its
    last steps)."""
    first = getattr(x, "first_step", 0)
    if not first:
        return x
    x = copy.copy(x)
    x.steps, x.first_step = x.steps - first, 0
    return x
