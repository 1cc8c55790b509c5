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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook

from ...adapters import delta
from ...cache.decision import latent_grid
from ...cache.hooks import BlockHooks, RecordingStream
from ...cache.modes import FULL, KV, NOCTX, Y, StepContext
from ...cache.modes import index as _index
from ...device import host_empty
from .prepare import cfg_rows

HOOK_NAME = "maskedit_masked_unet_block"


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


# ---------------------------------------------------------------------------------------------------------------
# The math. It mirrors BasicTransformerBlock.forward (norm_type "layer_norm", no positional embedding, self- then
# cross-attention then feed-forward) and AttnProcessor2_0 in diffusers 0.37 on gathered tokens; tests check it
# against the block's own forward.

def _attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(G, c, inner) queries over (G, N, inner) keys/values -> (G, c, inner), as AttnProcessor2_0 (before
    ``to_out``)."""
    g, hd = q.shape[0], q.shape[-1] // attn.heads
    split = lambda t: t.view(g, -1, attn.heads, hd).transpose(1, 2)  # noqa: E731
    o = F.scaled_dot_product_attention(split(q), split(k), split(v), dropout_p=0.0, is_causal=False)
    return o.transpose(1, 2).reshape(g, -1, attn.heads * hd).to(q.dtype)


def _out(attn, x: torch.Tensor) -> torch.Tensor:
    return attn.to_out[1](attn.to_out[0](x)) / attn.rescale_output_factor


def _same_counts(counts: list[int]) -> list[list[int]]:
    """Row positions grouped by computed-token count: a request's two guidance rows (and requests with masks of
    one size) attend in one batched call instead of one call per row."""
    groups: dict[int, list[int]] = {}
    for j, c in enumerate(counts):
        groups.setdefault(c, []).append(j)
    return list(groups.values())


def masked_unet_block(block, b: int, level: int, rows: list[int], views: list[UNetRowView], hidden, enc, out):
    """Compute batch ``rows`` of the block in their cached modes and write ``out``."""
    attn1 = block.attn1
    dev = hidden.device
    idx = [vw.tokens(level, dev) for vw in views]  # (computed, cached) per row
    counts = [int(c.numel()) for c, _ in idx]
    offs = np.cumsum([0] + counts)
    part = lambda t, j: t[int(offs[j]):int(offs[j + 1])]  # noqa: E731  row j's computed tokens of ``t``
    x = torch.cat([hidden[i, c] for i, (c, _) in zip(rows, idx)])  # computed tokens of every row
    # Adapter deltas (``maskedit.adapters.delta``): the request each input row of a layer belongs to.
    batch = hidden.shape[0]
    per_token = delta.owners(delta.batch_rows(rows, batch, counts))
    n1 = block.norm1(x)
    with per_token:
        q, k_c, v_c = attn1.to_q(n1), attn1.to_k(n1), attn1.to_v(n1)
    # Keys/values of cached tokens projected from the block's input rows (y mode), for all such rows at once.
    y_rows = [j for j, vw in enumerate(views) if vw.modes[b] == Y]
    kv_u = {}
    if y_rows:
        nu = block.norm1(torch.cat([hidden[rows[j], idx[j][1]] for j in y_rows]))
        sizes = [int(idx[j][1].numel()) for j in y_rows]
        with delta.owners(delta.batch_rows([rows[j] for j in y_rows], batch, sizes)):
            kv_u = dict(zip(y_rows, zip(attn1.to_k(nu).split(sizes), attn1.to_v(nu).split(sizes))))
    keys, vals = [], []
    for j, (i, vw) in enumerate(zip(rows, views)):
        c, u = idx[j]
        mode = vw.modes[b]
        if mode == NOCTX:
            keys.append(part(k_c, j))
            vals.append(part(v_c, j))
            continue
        if mode == KV:  # the request's loaded (R, N, ...) rows: this row's slot, computed rows written in place
            kj, vj = vw.rows(b, "kbuf")[vw.slot].flatten(-2), vw.rows(b, "vbuf")[vw.slot].flatten(-2)
        else:
            kj, vj = hidden.new_empty((hidden.shape[1], q.shape[1])), hidden.new_empty((hidden.shape[1], q.shape[1]))
            kj[u], vj[u] = kv_u[j]
        kj[c], vj[c] = part(k_c, j), part(v_c, j)
        keys.append(kj)
        vals.append(vj)
    attn_out = [None] * len(rows)
    for g in _same_counts(counts):
        o = _attend(attn1, torch.stack([part(q, j) for j in g]), torch.stack([keys[j] for j in g]),
                    torch.stack([vals[j] for j in g]))
        for j, oj in zip(g, o):
            attn_out[j] = oj
    with per_token:
        x = _out(attn1, torch.cat(attn_out)) + x
    if block.attn2 is not None:
        n2 = block.norm2(x)
        cross = [None] * len(rows)
        for g in _same_counts(counts):
            with delta.owners(delta.batch_rows([rows[j] for j in g], batch)):
                o = block.attn2(torch.stack([part(n2, j) for j in g]),
                                encoder_hidden_states=enc[_index([rows[j] for j in g], dev)])
            for j, oj in zip(g, o):
                cross[j] = oj
        x = torch.cat(cross) + x
    with per_token:
        x = block.ff(block.norm3(x)) + x
    for j, vw in enumerate(views):  # a heal's tokens among the computed ones: template context, recorded
        if vw.patch is not None:
            pos = vw.heal_idx[level][0]
            vw.patch.put_y(b, vw.slot, part(x, j)[pos])
            if vw.patch.wants_kv(b) and vw.modes[b] in (Y, KV):
                vw.patch.put_kv(b, vw.slot, part(k_c, j)[pos], part(v_c, j)[pos])
    for j, (i, vw) in enumerate(zip(rows, views)):
        c, _ = idx[j]
        if vw.needs_output[b]:
            out[i] = vw.rows(b, "y")[vw.slot]  # every row from the store; computed rows overwritten below
        elif out is not hidden:
            out[i] = hidden[i]
        out[i, c] = part(x, j)
