"""Mask-aware computation of SD 2 / SDXL UNet transformer blocks, attached to Diffusers' blocks as hooks.

Each ``BasicTransformerBlock`` of the UNet (every ``Transformer2DModel`` of the down, mid and up blocks, at every
resolution level) gets a hook, as the Flux blocks do (``families.flux_fill.cache``): with no context set it calls the block's own
forward. During a step the runner sets a context with one view per UNet batch row: with classifier-free guidance a
request has two rows (negative and positive prompt), both recorded and both read back, each in its own slot.

Per block and row the plan's modes mean what they mean for Flux:
- ``full``: the block's forward on every token (a recording row records its output rows and keys/values);
- ``y``: the masked tokens' self-attention queries, cross-attention and feed-forward only; keys/values of the cached
  tokens projected from the block's input rows; cached tokens' output rows from the store;
- ``kv``: as ``y`` with the cached tokens' keys/values from the store.
Self-attention is the only place tokens meet, so this is exact for the computed tokens given the cached rows.

What runs in full: the ResNets, down/up-sampling, GroupNorm and the in/out projections of each ``Transformer2DModel``
(convolutions and group statistics mix neighbouring tokens; they are a quarter of an SDXL step). So the first block
of every ``Transformer2DModel`` sees freshly computed input rows for every token (its ``y`` keys/values are exact
for the current request), and every such model's last block writes all output rows (its ``proj_out`` reads them).

A request's ControlNets (the UNet's down path and mid block) get the same hooks and their own entries beside the
UNet's (``maskedit.cache.controlnet``): on a hit they compute their blocks' masked rows only, and their residuals,
made by full-token convolutions, are added by the UNet on every token where its forward adds them.

Tokens are latent pixels; a block at level ``l`` (the UNet halves the grid ``l`` times) works on the grid
``(h >> l, w >> l)``, and a token there is computed if any latent pixel under it is. A hit heals its entry's
invalid pixels outside its own cells at the coarsest level (``heal_rows``): their tokens at every level are then
template context, recorded by the hit block by block (``UNetRowView.patch``).

Here: the hooks and what the cache runtime asks of them (``UNetCacheHooks``, ``MaskedUNetBlockHook``). A request's
rows (``level_mask``, ``UNetRowView``, ``heal_rows``, ``UNetRecorder``) are in ``rows``, the masked block's math
(``masked_unet_block``) in ``masked_block``.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.hooks import ModelHook

from ...adapters import delta
from ...cache.decision import latent_grid
from ...cache.hooks import BlockHooks
from ...cache.modes import FULL, KV, NOCTX, Y
from ...cache.modes import index as _index
from .masked_block import masked_unet_block
from .prepare import cfg_rows
# A request's rows (views, recorder) and the block math are modules of their own; their names stay importable here.
from .rows import UNetRecorder, UNetRowView, heal_rows, level_mask, per_unet_row  # noqa: F401

HOOK_NAME = "maskedit_masked_unet_block"


class UNetCacheHooks(BlockHooks):
    """Attach / detach the masked-block hooks on a ``UNet2DConditionModel``; the blocks' levels and widths."""

    HOOK_NAME = HOOK_NAME
    layout = "per_block"  # entry arrays y.<b> / k.<b> / v.<b> (blocks differ in tokens and width)

    def __init__(self, unet):
        blocks, self.levels, self.group_last = [], [], []
        n = len(unet.down_blocks)
        groups = [(a, i) for i, blk in enumerate(unet.down_blocks) for a in getattr(blk, "attentions", None) or []]
        groups += [(a, n - 1) for a in getattr(unet.mid_block, "attentions", None) or []]
        # A ControlNet (``ControlNetModel``, ``ControlNetUnionModel``: the UNet's down path and mid block) has none.
        groups += [(a, n - 1 - j) for j, blk in enumerate(getattr(unet, "up_blocks", None) or [])
                   for a in getattr(blk, "attentions", None) or []]
        for model, level in groups:  # execution order: down, mid, up; within a model its blocks in order
            for k, block in enumerate(model.transformer_blocks):
                blocks.append(block)
                self.levels.append(level)
                self.group_last.append(k == len(model.transformer_blocks) - 1)
        self.dims = [int(b.norm1.normalized_shape[0]) for b in blocks]
        self.coarsest = max(self.levels, default=0)  # what a hit may heal depends on it (``heal_candidates``)
        self.n_dual = 0
        # Cost-model kinds: one per level (its blocks share width and token count; calibrated as ``unet-l<level>``).
        self.kinds = [f"unet-l{lv}" for lv in self.levels]
        self._attach(unet, blocks, MaskedUNetBlockHook)

    @property
    def dim(self) -> int:
        """The width signature an entry is checked against (``decision.fits``)."""
        return int(sum(self.dims))

    # -- ControlNets cached beside this UNet (``maskedit.cache.controlnet``): residuals from full-token convolutions
    controlnet_reads_every_block = False  # as in the UNet, a Transformer2DModel's last block writes all its rows

    @staticmethod
    def caches_controlnet(model) -> bool:
        return model is not None and hasattr(model, "down_blocks") and hasattr(model, "controlnet_down_blocks")

    @staticmethod
    def controlnet_hooks(model) -> "UNetCacheHooks":
        return UNetCacheHooks.of(model)

    # -- geometry of one request ---------------------------------------------------------------------
    def shapes(self, grid: tuple[int, int]) -> dict[int, tuple[int, int]]:
        """Block -> (tokens, width) for a request on latent grid ``grid``."""
        h, w = grid
        return {b: ((h >> lv) * (w >> lv), d) for b, (lv, d) in enumerate(zip(self.levels, self.dims))}

    def computed_counts(self, computed: np.ndarray, grid: tuple[int, int]) -> list[int]:
        by_level = {lv: int(level_mask(computed, grid, lv).sum()) for lv in set(self.levels)}
        return [by_level[lv] for lv in self.levels]

    # -- what the cache runtime asks of a family's hooks (see ``cache.rows.TokenRowHooks``) -------------------
    def kv_heads(self) -> tuple[int, int]:
        return 1, 1  # keys / values are read back as (rows, tokens, width) whatever the heads

    def text_len(self, x) -> int:
        return 0  # cross-attention: the text is not in the self-attention keys / values

    def block_bytes(self, x, itemsize: int) -> list[int]:
        r, shapes = cfg_rows(x.guidance), self.shapes(latent_grid(x, x.latents.shape[0]))
        return [x.steps * r * shapes[b][0] * shapes[b][1] * itemsize for b in range(len(self.blocks))]

    def recorder(self, x, y_blocks: list[int], kv_blocks: list[int], dtype, device) -> tuple["UNetRecorder", dict]:
        r, grid = cfg_rows(x.guidance), latent_grid(x, x.latents.shape[0])
        rec = UNetRecorder(x.steps, r, self.shapes(grid), y_blocks, kv_blocks, dtype, device)
        return rec, {"layout": self.layout, "rows": r, "grid": list(grid)}

    def plan_blocks(self, x, computed, meta: dict):
        grid = latent_grid(x, x.latents.shape[0])
        shapes, r = self.shapes(grid), meta.get("rows", 1)
        return [(shapes[b][0] * r, c * r, shapes[b][1]) for b, c in enumerate(self.computed_counts(computed, grid))]

    def view(self, job, jc, rows=None, recorder=None) -> "UNetRowView":
        x = job.inputs
        view = UNetRowView(modes=jc.modes, grid=latent_grid(x, x.latents.shape[0]), computed=jc.computed, rows=rows,
                           needs_output=jc.needs_output, recorder=recorder, patch=jc.patch, heal_idx=jc.heal_idx)
        if jc.level_idx is None:
            jc.level_idx = view._memo  # per-level token indices, made once per request
        view._memo = jc.level_idx
        return view

    def heal_recorder(self, jc, x, heal, idx_c, meta: dict, dtype, device) -> None:
        """A UNet's heal rows per block, at the heal's tokens on that block's level."""
        grid = latent_grid(x, x.latents.shape[0])
        jc.heal_idx = heal_rows(self, heal, jc.computed, grid, jc.idx_c.device)
        shapes = {b: (int(jc.heal_idx[lv][1].numel()), self.dims[b]) for b, lv in enumerate(self.levels)}
        jc.patch = UNetRecorder(x.steps, meta.get("rows", 1), shapes, meta["y_blocks"], meta["kv_blocks"], dtype,
                                device)
        jc.patch.index = {b: jc.heal_idx[lv][1].cpu() for b, lv in enumerate(self.levels)}

    def needs_output(self, modes: list[str]) -> list[bool]:
        """As ``policy.needs_output``, but the last block of each ``Transformer2DModel`` always writes its rows
        (``proj_out`` reads every token) and a model's first block reads fresh input rows, not its predecessor's."""
        out = []
        for b, m in enumerate(modes):
            nxt = None if self.group_last[b] else modes[b + 1]
            out.append(m in (Y, NOCTX) or (m == KV and (nxt is None or nxt in (FULL, Y, NOCTX))))
        return out


class MaskedUNetBlockHook(ModelHook):
    def __init__(self, owner: UNetCacheHooks, index: int):
        super().__init__()
        self.owner, self.index = owner, index

    def new_forward(self, module, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
        forward = self.fn_ref.original_forward
        ctx = self.owner.context
        if ctx is not None and ctx.on_block is not None:
            ctx.on_block(self.index)
        call = lambda h, e: forward(h, attention_mask=attention_mask, encoder_hidden_states=e, **kwargs)  # noqa
        if ctx is None or all(r is None or (r.all_full and r.recorder is None and r.patch is None) for r in ctx.rows):
            return call(hidden_states, encoder_hidden_states)
        b = self.index
        full_rows = [i for i, r in enumerate(ctx.rows) if r is None or r.modes[b] == FULL]
        masked_rows = [i for i in range(len(ctx.rows)) if i not in full_rows]
        out = torch.empty_like(hidden_states) if full_rows else hidden_states
        batch = hidden_states.shape[0]
        if full_rows:
            sel = _index(full_rows, hidden_states.device)
            with delta.owners(delta.batch_rows(full_rows, batch)):  # adapters' rows: these requests'
                h = call(hidden_states[sel], encoder_hidden_states[sel])
            out[sel] = h
            for j, i in enumerate(full_rows):
                vw = ctx.rows[i]
                if vw is not None and vw.recorder is not None:
                    with delta.owners(delta.batch_rows([i], batch, [hidden_states.shape[1]])):
                        _record(module, b, vw.recorder, vw.slot, h[j], hidden_states[i])
                if vw is not None and vw.patch is not None:  # a heal's tokens, computed here with all the others
                    t = vw.heal_idx[self.owner.levels[b]][1]
                    with delta.owners(delta.batch_rows([i], batch, [int(t.numel())])):
                        _record(module, b, vw.patch, vw.slot, h[j, t], hidden_states[i, t])
        if masked_rows:
            masked_unet_block(module, b, self.owner.levels[b], masked_rows, [ctx.rows[i] for i in masked_rows],
                              hidden_states, encoder_hidden_states, out)
        return out


def _record(block, b: int, rec: UNetRecorder, slot: int, out: torch.Tensor, inp: torch.Tensor) -> None:
    """Record a block's output rows ``out`` and, where wanted, the self-attention keys/values of its input ``inp``."""
    rec.put_y(b, slot, out)
    if rec.wants_kv(b):
        n1 = block.norm1(inp)
        rec.put_kv(b, slot, block.attn1.to_k(n1), block.attn1.to_v(n1))
