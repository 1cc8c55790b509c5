"""A request's rows in the UNet's masked blocks: which tokens it computes at each level (``level_mask``), its view
per UNet batch row (``UNetRowView``: modes, loaded rows, a heal's tokens), and the recorder of a template run's rows
(``UNetRecorder``). The hooks that use them are in ``cache``, the masked block's math in ``masked_block``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ...cache.hooks import RecordingStream
from ...cache.modes import FULL, StepContext
from ...device import host_empty


def level_mask(computed: np.ndarray, grid: tuple[int, int], level: int) -> np.ndarray:
    """Latent-pixel mask (h*w,) pooled to level ``level``: a token is set if any pixel under it is."""
    h, w = grid
    f = 1 << level
    return computed.reshape(h // f, f, w // f, f).any(axis=(1, 3)).reshape(-1)


@dataclass
class UNetRowView:
    """One UNet batch row of a request (``slot`` 0/1: the negative / positive prompt's row under guidance)."""

    modes: list[str]
    grid: tuple[int, int]  # the request's latent grid (h, w)
    computed: np.ndarray | None = None  # (h*w,) bool: latent pixels this request computes (a hit)
    slot: int = 0
    rows: Callable[[int, str], torch.Tensor] | None = None  # (block, kind) -> the loaded (R, N_b, D_b) rows
    needs_output: list[bool] = field(default_factory=list)
    recorder: "UNetRecorder | None" = None
    patch: "UNetRecorder | None" = None  # a hit healing its entry: rows of the heal's tokens (``heal_rows``)
    heal_idx: dict | None = None  # level -> (positions among the computed tokens, token indices) of the heal
    _memo: dict = field(default_factory=dict)  # level -> (computed, cached) token indices on the device

    def tokens(self, level: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if level not in self._memo:
            m = level_mask(self.computed, self.grid, level)
            self._memo[level] = (torch.from_numpy(np.flatnonzero(m)).to(device),
                                 torch.from_numpy(np.flatnonzero(~m)).to(device))
        return self._memo[level]

    @property
    def all_full(self) -> bool:
        return all(m == FULL for m in self.modes)


def heal_rows(hooks: "UNetCacheHooks", heal: np.ndarray, computed: np.ndarray, grid: tuple[int, int],
              device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per level, the tokens a heal of latent pixels ``heal`` rewrites: (their positions among the level's computed
    tokens, their indices). ``heal`` lies outside the hit's own cells at the coarsest level (``heal_candidates``),
    so at every level its tokens hold template context only, and all of them are computed (they are invalid)."""
    out = {}
    for lv in set(hooks.levels):
        tok = np.flatnonzero(level_mask(heal, grid, lv))
        comp = np.flatnonzero(level_mask(computed, grid, lv))
        out[lv] = (torch.from_numpy(np.searchsorted(comp, tok)).to(device), torch.from_numpy(tok).to(device))
    return out


def per_unet_row(ctx: StepContext, r: int) -> StepContext:
    """The runner's per-request context as one view per UNet row: ``r`` slots of each request share its loads."""
    rows = []
    for v in ctx.rows:
        if v is None:
            rows.extend([None] * r)
            continue
        if v.rows is not None:
            v.rows = _shared(v.rows)
        rows.extend([v] + [UNetRowView(**{**vars(v), "slot": s, "_memo": v._memo}) for s in range(1, r)])
    return StepContext(rows, on_block=ctx.on_block)


def _shared(get):
    """A row getter whose loads are taken once and shared by the request's guidance rows."""
    got: dict = {}

    def once(b: int, kind: str) -> torch.Tensor:
        if (b, kind) not in got:
            got[(b, kind)] = get(b, kind)
        return got[(b, kind)]

    return once


class UNetRecorder(RecordingStream):
    """A template run's rows per block in the model's dtype, in host memory (pinned on a GPU): ``y.<b>`` of shape
    (steps, R, N_b, D_b) for the recorded blocks' outputs, ``k.<b>`` / ``v.<b>`` for their self-attention keys and
    values. Copies run on the recording stream as for Flux (``cache.rows.Recorder``)."""

    def __init__(self, steps: int, r: int, shapes: dict[int, tuple[int, int]], y_blocks: list[int],
                 kv_blocks: list[int], dtype: torch.dtype = torch.float32, device="cpu"):
        self._start_recording(device)
        self.r = r
        self.y = {b: host_empty((steps, r) + shapes[b], dtype, device) for b in y_blocks}
        self.k = {b: host_empty((steps, r) + shapes[b], dtype, device) for b in kv_blocks}
        self.v = {b: host_empty((steps, r) + shapes[b], dtype, device) for b in kv_blocks}
        self.steps = steps

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.y, self.k, self.v) for t in d.values())

    @property
    def complete(self) -> bool:
        return self.writes == self.steps * self.r * (len(self.y) + len(self.k))

    def put_y(self, block: int, slot: int, rows: torch.Tensor) -> None:
        if block in self.y:
            self._copy_out(self.y[block][self.step, slot], rows)
            self._written.add((self.step, "y", block, slot))

    def wants_kv(self, block: int) -> bool:
        return block in self.k

    def put_kv(self, block: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._copy_out(self.k[block][self.step, slot], k)
        self._copy_out(self.v[block][self.step, slot], v)
        self._written.add((self.step, "kv", block, slot))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"y.{b}": t for b, t in self.y.items()}
        out.update({f"k.{b}": t for b, t in self.k.items()})
        out.update({f"v.{b}": t for b, t in self.v.items()})
        return out
