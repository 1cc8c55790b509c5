"""A request's view of one denoiser call and its template run's recording, for transformer families whose blocks
all see the same image tokens (Flux Fill, FLUX.2): entries hold ``y`` / ``k`` / ``v`` arrays of shape
(steps, blocks, tokens, width). A UNet's blocks differ in tokens and width: its family has its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..device import host_empty
from .hooks import BlockHooks, RecordingStream
from .modes import FULL
from .policy import needs_output


@dataclass
class RowView:
    """What one request contributes to one transformer call."""

    modes: list[str]  # per block (all blocks, dual then single)
    idx_c: torch.Tensor | None = None  # image tokens computed (sorted, long)
    idx_u: torch.Tensor | None = None  # image tokens taken from the cache
    # (block, kind) -> loaded tensor: "y" the block's recorded output (N, D); "kbuf"/"vbuf" a (1, L+N, H, hd)
    # buffer whose image part holds the recorded keys/values (rotary applied).
    rows: Callable[[int, str], torch.Tensor] | None = None
    needs_output: list[bool] = field(default_factory=list)  # per block: write cached output rows?
    recorder: "Recorder | None" = None  # set on a recording (template) run
    # A hit that computes tokens its entry holds invalid (another request's edit) but that it leaves unmasked:
    # their rows are template context again, recorded here (at ``patch_pos`` among ``idx_c``) to heal the entry.
    patch: "Recorder | None" = None
    patch_pos: torch.Tensor | None = None
    # Packed calls only (rows padded to the longest request): this request's image tokens and its own rotary
    # tables over [text; image]; None means the call's own length and tables.
    tokens: int | None = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    _memo: dict = field(default_factory=dict)  # per step: positions and rotary tables shared by all blocks

    def n_image(self, N: int) -> int:
        return self.tokens if self.tokens is not None else N

    def tables(self, rope):
        return self.rope if self.rope is not None else rope

    def gathered(self, b: int, L: int, rope, N: int, device) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """For block ``b``: (image tokens computed, their sequence positions after the text, rotary tables at
        [text; those tokens]). ``full`` computes every token of the row, the cached modes the masked ones."""
        kind = "all" if self.modes[b] == FULL else "masked"
        if kind not in self._memo:
            cols = torch.arange(self.n_image(N), device=device) if kind == "all" else self.idx_c
            pos = torch.cat([torch.arange(L, device=device), cols + L])
            r = self.tables(rope)
            self._memo[kind] = (cols, pos, (r[0][pos], r[1][pos]))
        return self._memo[kind]

    def rope_u(self, rope, L: int):
        if "cs_u" not in self._memo:
            pos = self.idx_u + L
            r = self.tables(rope)
            self._memo["cs_u"] = (r[0][pos], r[1][pos])
        return self._memo["cs_u"]

    @property
    def all_full(self) -> bool:
        return all(m == FULL for m in self.modes)


class Recorder(RecordingStream):
    """Collects a template run's block outputs (and keys/values within budget) for every step, in the model's
    dtype, in host memory (pinned when the model is on a GPU).

    On a GPU the device-to-host copies run on their own stream, after the kernels that produced the rows, so the
    step never waits for them; ``step_event(s)`` marks when step ``s``'s rows have landed (followers' loads wait on
    it on the GPU) and ``synchronize`` waits for all of them (before the entry is written)."""

    def __init__(self, steps: int, tokens: int, dim: int, inner: int, y_blocks: list[int], kv_blocks: list[int],
                 dtype: torch.dtype = torch.float32, device="cpu"):
        self._start_recording(device)
        self.y_slot = {b: i for i, b in enumerate(y_blocks)}
        self.kv_slot = {b: i for i, b in enumerate(kv_blocks)}
        # Not zeroed: every slot is written before the rows are read (``complete``, or a step a follower waits for).
        self.y = host_empty((steps, len(y_blocks), tokens, dim), dtype, device)
        self.k = host_empty((steps, len(kv_blocks), tokens, inner), dtype, device)
        self.v = host_empty((steps, len(kv_blocks), tokens, inner), dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.y, self.k, self.v))

    @property
    def complete(self) -> bool:
        return self.writes == self.y.shape[0] * (self.y.shape[1] + self.k.shape[1])

    def put_y(self, block: int, hidden: torch.Tensor) -> None:
        if block in self.y_slot:
            self._copy_out(self.y[self.step, self.y_slot[block]], hidden)
            self._written.add((self.step, "y", block))

    def wants_kv(self, block: int) -> bool:
        return block in self.kv_slot

    def put_kv(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slot = self.kv_slot[block]
        self._copy_out(self.k[self.step, slot], k.flatten(-2))
        self._copy_out(self.v[self.step, slot], v.flatten(-2))
        self._written.add((self.step, "kv", block))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"y": self.y, "k": self.k, "v": self.v}


class TokenRowHooks(BlockHooks):
    """Masked-block hooks of a transformer whose blocks all see the same image tokens at one width: what the cache
    runtime asks of any family's hooks, for this layout. A family's hooks subclass it and attach their blocks
    (``_attach``); ``n_dual``: how many leading blocks are dual-stream (their cost-model kind)."""

    layout = "stacked"  # entry arrays y / k / v of shape (steps, blocks, tokens, width)
    n_dual = 0
    coarsest = 0  # (a UNet's deepest level: what a hit may heal; none here)

    @property
    def kinds(self) -> list[str]:
        """Per block, its cost-model kind."""
        return ["dual"] * self.n_dual + ["single"] * (len(self.blocks) - self.n_dual)

    @property
    def dim(self) -> int:
        cfg = self.transformer.config
        return cfg.num_attention_heads * cfg.attention_head_dim

    def kv_heads(self) -> tuple[int, int]:
        """(heads, head_dim) of the keys / values the loader reshapes cached rows into."""
        cfg = self.transformer.config
        return cfg.num_attention_heads, cfg.attention_head_dim

    def text_len(self, x) -> int:
        """Text tokens ahead of the image tokens in a block's keys / values buffer."""
        return int(x.prompt_embeds.shape[0])

    def block_bytes(self, x, itemsize: int) -> list[int]:
        """Per block, the bytes of a template run's recorded outputs (keys and values: twice that): a row per
        image token and per reference token."""
        return [x.steps * self.cache_mask(x).size * self.dim * itemsize] * len(self.blocks)

    def recorder(self, x, y_blocks: list[int], kv_blocks: list[int], dtype, device) -> tuple["Recorder", dict]:
        """A template run's recorder and what its entry's metadata adds."""
        return Recorder(x.steps, self.cache_mask(x).size, self.dim, self.dim, y_blocks, kv_blocks, dtype,
                        device), {}

    @staticmethod
    def temporal_cols(view: RowView, n_img: int):
        """The image-stream tokens a hit computes, what its temporal residuals cover (``maskedit.temporal``): its
        masked ones (``idx_c``; reference rows come from the entry like unmasked ones)."""
        return view.idx_c

    def plan_blocks(self, x, computed, meta: dict):
        """Per-block (tokens, computed, width) for the planner when blocks differ; None: all alike."""
        return None

    def needs_output(self, modes: list[str]) -> list[bool]:
        return needs_output(modes)

    def view(self, job, jc, rows=None, recorder=None) -> RowView:
        """``job``'s view of this step: recording (``recorder``), or a hit reading cached ``rows``."""
        if recorder is not None:
            return RowView(modes=jc.modes, recorder=recorder)
        return RowView(modes=jc.modes, idx_c=jc.idx_c, idx_u=jc.idx_u, needs_output=jc.needs_output, rows=rows,
                       patch=jc.patch, patch_pos=jc.patch_pos)

    def heal_recorder(self, jc, x, heal, idx_c, meta: dict, dtype, device) -> None:
        """Set ``jc.patch`` (and where its rows sit among the computed ones) to record the rows of ``jc.heal``."""
        jc.patch = Recorder(x.steps, jc.heal.size, self.dim, self.dim, meta["y_blocks"], meta["kv_blocks"], dtype,
                            device)
        jc.patch_pos = torch.from_numpy(np.searchsorted(idx_c, jc.heal)).to(jc.idx_c.device)
