"""Mask-aware computation of Flux transformer blocks, attached to Diffusers' blocks as hooks. The blocks are those of
Diffusers' ``FluxTransformer2DModel`` (Flux Fill's and FLUX.1-dev's), so the ``flux_fill`` and ``flux_controlnet``
families share them.

Each ``FluxTransformerBlock`` / ``FluxSingleTransformerBlock`` gets a ``MaskedBlockHook`` (Diffusers'
``HookRegistry``). With no context set the hook calls the block's own forward: plain Diffusers behaviour
is untouched. During a denoise step the runner sets a ``StepContext`` holding one ``RowView`` per batch
row (per request), so state is per request, not per module: requests at different steps and with
different masks share one transformer call.

Per row and block the plan says:
- ``full``: the block's own forward on every token (and, for a recording row, its outputs are recorded);
- ``y``: queries, attention output, MLP and norms for the computed tokens only; keys/values of the
  cached tokens projected from their cached input rows; output rows of cached tokens from the store;
- ``kv``: as ``y`` but keys/values of cached tokens come from the store (no projection at all);
- ``noctx``: computed tokens attend only to themselves and the text (the naive shortcut; a fidelity
  lower bound for benchmarks).
Text tokens are always computed. Rotary embeddings follow the gathered token positions. Token-wise work
(norms, projections, MLP) runs on the computed tokens of all rows concatenated, with no padding; attention
runs per row.

A *packed* context (``StepContext.packed``) carries requests of different resolutions in one call: the runner
pads their rows to the longest and each ``RowView`` knows its own token count and rotary tables. Then every
row goes through the gathered path, ``full`` meaning "all of this row's tokens computed" (which is exactly the
block's forward on that request alone), so padding never reaches attention or the block's token-wise work.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

from ..adapters import delta
from .modes import FULL, KV, NOCTX, Y
from .modes import index as _index
from .rows import RowView, TokenRowHooks

HOOK_NAME = "maskedit_masked_block"


class FluxCacheHooks(TokenRowHooks):
    """Attach / detach the masked-block hooks on a ``FluxTransformer2DModel`` and hold the step context."""

    HOOK_NAME = HOOK_NAME
    # A block with no full rows writes its computed rows into its input tensor (the previous block's output, which
    # the transformer's forward no longer reads). A ControlNet keeps every block's output (its block samples):
    # its hooks allocate a fresh output instead (``FluxControlNetCacheHooks``).
    reuse_input = True

    def __init__(self, transformer):
        self.n_dual = len(transformer.transformer_blocks)
        self._attach(transformer, list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks),
                     MaskedBlockHook)

    @property
    def dim(self) -> int:
        return self.transformer.inner_dim if hasattr(self.transformer, "inner_dim") else \
            self.transformer.config.num_attention_heads * self.transformer.config.attention_head_dim

    # -- ControlNets cached beside this model (``cache.controlnet``) --------------------------------------
    controlnet_reads_every_block = True  # its residuals are its blocks' outputs: a hit writes every block's rows

    @staticmethod
    def caches_controlnet(model) -> bool:
        return model is not None and hasattr(model, "transformer_blocks")  # a FluxControlNetModel loaded here

    @staticmethod
    def controlnet_hooks(model) -> "FluxControlNetCacheHooks":
        return FluxControlNetCacheHooks.of(model)


class FluxControlNetCacheHooks(FluxCacheHooks):
    """The same hooks on a ``FluxControlNetModel``'s blocks (the base transformer's block classes): its block outputs
    are kept as its samples, so no block writes into its input."""

    reuse_input = False


class MaskedBlockHook(ModelHook):
    def __init__(self, owner: FluxCacheHooks, index: int):
        super().__init__()
        self.owner, self.index = owner, index

    def new_forward(self, module, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                    joint_attention_kwargs=None):
        forward = self.fn_ref.original_forward
        ctx = self.owner.context
        if ctx is not None and ctx.on_block is not None:
            ctx.on_block(self.index)
        b = self.index
        tp = ctx.temporal if ctx is not None else None  # temporal reuse (``maskedit.temporal``): rows that skip
        if tp is not None:
            tp.enter(ctx, b, hidden_states, encoder_hidden_states)
        skip = ctx.skipped(b) if ctx is not None else []
        if ctx is None or (not ctx.packed and not skip and all(r is None or (r.all_full and r.recorder is None)
                                                               for r in ctx.rows)):
            out_txt, out_img = forward(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                       temb=temb, image_rotary_emb=image_rotary_emb,
                                       joint_attention_kwargs=joint_attention_kwargs)
            if tp is not None:
                tp.exit(ctx, b, out_img, out_txt)
            return out_txt, out_img
        # Padded rows must not meet in the block's own attention: a packed call runs every row gathered.
        full_rows = [] if ctx.packed else [i for i, r in enumerate(ctx.rows)
                                           if (r is None or r.modes[b] == FULL) and i not in skip]
        masked_rows = [i for i in range(len(ctx.rows)) if i not in full_rows and i not in skip]
        out_txt = torch.empty_like(encoder_hidden_states)
        # With no full rows the block's input (the previous block's output, ours to reuse) becomes its output:
        # only the computed rows are scattered in, sparing a copy of every token per block.
        out_img = torch.empty_like(hidden_states) if full_rows or not self.owner.reuse_input else hidden_states
        batch = hidden_states.shape[0]
        for i in skip:  # a reused middle block: the row passes through (its residual is added at the last one)
            out_txt[i] = encoder_hidden_states[i]
            if out_img is not hidden_states:
                out_img[i] = hidden_states[i]
        if full_rows:
            sel = _index(full_rows, hidden_states.device)
            with delta.owners(delta.batch_rows(full_rows, batch)):  # adapters' rows: these requests'
                t, h = forward(hidden_states=hidden_states[sel], encoder_hidden_states=encoder_hidden_states[sel],
                               temb=temb[sel], image_rotary_emb=image_rotary_emb,
                               joint_attention_kwargs=joint_attention_kwargs)
            out_txt[sel], out_img[sel] = t, h
            for j, i in enumerate(full_rows):
                rec = ctx.rows[i].recorder if ctx.rows[i] is not None else None
                if rec is not None:
                    rec.put_y(b, h[j])
                    if rec.wants_kv(b):
                        with delta.owners(delta.batch_rows([i], batch)):
                            k, v = image_kv(module, hidden_states[i:i + 1], temb[i:i + 1], image_rotary_emb,
                                            encoder_hidden_states.shape[1])
                        rec.put_kv(b, k[0], v[0])
        if masked_rows:
            views = [ctx.rows[i] for i in masked_rows]
            masked_block(module, b, masked_rows, views, hidden_states, encoder_hidden_states, temb,
                         image_rotary_emb, out_img, out_txt)
        if tp is not None:
            tp.exit(ctx, b, out_img, out_txt)
        return out_txt, out_img


# ---------------------------------------------------------------------------------------------------------------
# The math. It mirrors FluxTransformerBlock.forward / FluxSingleTransformerBlock.forward / FluxAttnProcessor
# in diffusers 0.42 on gathered tokens; tests check it against the blocks' own forward.

def _modulation(norm, temb: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """AdaLayerNormZero(Single) modulation vectors for each row: n chunks of (rows, dim)."""
    return norm.linear(norm.silu(temb)).chunk(n, dim=1)


def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (1, S, H, hd) at sequence positions ``pos``."""
    return apply_rotary_emb(x, (rope[0][pos], rope[1][pos]), sequence_dim=1)


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, hd))


def _per_token(t: torch.Tensor, rows: list[int], counts: list[int]) -> torch.Tensor:
    """Row ``rows[j]`` of ``t`` (R, D) repeated ``counts[j]`` times, stacked: per-request modulation vectors
    expanded to that request's tokens. Counts stay on the host (``repeat_interleave`` with device counts would
    read them back: a sync)."""
    if len(rows) == 1:
        return t[rows[0]:rows[0] + 1]  # broadcasts over the request's tokens
    return torch.cat([t[r:r + 1].expand(c, -1) for r, c in zip(rows, counts)])


def image_kv(block, hidden: torch.Tensor, temb: torch.Tensor, rope, txt_len: int):
    """Keys/values of every image token of one row (as the block computes them), rotary applied."""
    attn = block.attn
    if isinstance(block, FluxTransformerBlock):
        shift, scale = _modulation(block.norm1, temb, 6)[:2]
        normed = block.norm1.norm(hidden) * (1 + scale[:, None]) + shift[:, None]
    else:
        shift, scale = _modulation(block.norm, temb, 3)[:2]
        normed = block.norm.norm(hidden) * (1 + scale[:, None]) + shift[:, None]
    k = attn.norm_k(_heads(attn.to_k(normed), attn.head_dim))
    v = _heads(attn.to_v(normed), attn.head_dim)
    pos = torch.arange(hidden.shape[1], device=hidden.device) + txt_len
    return _rope(k, rope, pos), v


def _sdpa(q, k, v):
    """(1, S, H, hd) layout like Diffusers' dispatch_attention_fn."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2, 3)


class _FusedInputs:
    """A block's projections that read the same normalized input, stacked into one weight so the gathered path
    does one GEMM instead of three or four (``[q; k; v]`` of the image stream, plus the MLP input in a single
    block; ``[q; k; v]`` of the text stream in a dual block). The layers' own parameters are then re-pointed at
    row slices of the stacked tensors: same values and layout, so plain Diffusers calls compute exactly as before,
    and no weight is held twice (on a GPU serving a 12B model that matters). Rebuilt if a layer's weight is
    replaced or changed in place (new weights loaded, a dtype change)."""

    _by_block: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, layers: list):
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in layers])
            self.bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                                   for m in layers])
            off = 0
            for m in layers:
                n = m.weight.shape[0]
                m.weight = torch.nn.Parameter(self.weight[off:off + n], requires_grad=m.weight.requires_grad)
                if m.bias is not None:
                    m.bias = torch.nn.Parameter(self.bias[off:off + n], requires_grad=m.bias.requires_grad)
                off += n
        self.key = _weights_key(layers)
        self.layers = layers  # whose adapter deltas go on which columns (``delta.add_fused``)

    @classmethod
    def of(cls, block, name: str, layers: list) -> "_FusedInputs":
        per_block = cls._by_block.setdefault(block, {})
        f = per_block.get(name)
        if f is None or f.key != _weights_key(layers):
            f = per_block[name] = cls(layers)
        return f

    def __call__(self, x: torch.Tensor, rows: slice = slice(None), layers: slice = slice(None)) -> torch.Tensor:
        """The stacked output (its features ``rows``, which are those of ``self.layers[layers]``) with the active
        adapters' deltas of each layer on its own columns (the layout of ``x``'s rows: ``delta.owners``)."""
        return delta.add_fused(self.layers[layers], x, F.linear(x, self.weight[rows], self.bias[rows]))


def _weights_key(layers: list) -> tuple:
    return tuple((m.weight.data_ptr(), m.weight._version) for m in layers)


def _inputs(block, dual: bool) -> _FusedInputs:
    a = block.attn
    return _FusedInputs.of(block, "img", [a.to_q, a.to_k, a.to_v] + ([] if dual else [block.proj_mlp]))


def masked_block(block, b: int, rows: list[int], views: list[RowView], hidden, enc, temb, rope, out_img, out_txt):
    """Compute ``rows`` of the batch in their cached modes and write ``out_img`` / ``out_txt``."""
    dual = isinstance(block, FluxTransformerBlock)
    attn = block.attn
    hd = attn.head_dim
    dev = hidden.device
    L = enc.shape[1]
    N = hidden.shape[1]
    sel = _index(rows, dev)
    temb_r = temb[sel]
    gat = [vw.gathered(b, L, rope, N, dev) for vw in views]  # (computed image tokens, positions, rotary)
    cols = [g[0] for g in gat]
    counts_c = [int(c.numel()) for c in cols]
    # Tokens each row computes: its image tokens ``cols`` (dual: text goes through its own stream; single: text
    # rows are part of the same sequence and come first).
    counts = counts_c if dual else [L + c for c in counts_c]
    # Adapter deltas (``maskedit.adapters.delta``): which request each input row of a layer belongs to, for
    # per-request layers (modulation, the text stream: one row each) and token-wise ones (computed tokens).
    per_row = delta.batch_rows(rows, hidden.shape[0])
    per_token = delta.batch_rows(rows, hidden.shape[0], counts)
    with delta.owners(per_row):
        if dual:
            mods = _modulation(block.norm1, temb_r, 6)
            cmods = _modulation(block.norm1_context, temb_r, 6)
        else:
            mods = _modulation(block.norm, temb_r, 3)
    if dual:
        shift, scale, gate, shift_m, scale_m, gate_m = mods
        x = hidden[rows[0], cols[0]] if len(rows) == 1 else torch.cat([hidden[i, c] for i, c in zip(rows, cols)])
        norm = block.norm1.norm
    else:
        shift, scale, gate = mods
        x = torch.cat([t for i, c in zip(rows, cols) for t in (enc[i], hidden[i, c])])
        norm = block.norm.norm
    every = list(range(len(rows)))
    E = lambda t: _per_token(t, every, counts)  # noqa: E731  per-request vectors to per-token
    # Element-wise steps are written exactly as Diffusers' blocks write them (not fused, e.g. with addcmul), so a
    # hit on the recording request's own mask reproduces the template run to the bit.
    normed = norm(x) * (1 + E(scale)) + E(shift)
    fused = _inputs(block, dual)
    inner = attn.to_q.weight.shape[0]
    with delta.owners(per_token):
        proj = fused(normed)  # [q | k | v (| mlp)] per token
    # queries and keys side by side (2H heads): one rotary call per request covers both
    qk = torch.cat([attn.norm_q(_heads(proj[:, :inner], hd)), attn.norm_k(_heads(proj[:, inner:2 * inner], hd))], 1)
    v = _heads(proj[:, 2 * inner:3 * inner], hd)
    if dual:
        t_norm = block.norm1_context.norm(enc[sel]) * (1 + cmods[1][:, None]) + cmods[0][:, None]
        with delta.owners(per_row):
            tproj = _FusedInputs.of(block, "txt", [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj])(t_norm)
        tqk = torch.cat([attn.norm_added_q(_heads(tproj[..., :inner], hd)),
                         attn.norm_added_k(_heads(tproj[..., inner:2 * inner], hd))], 2)
        tv = _heads(tproj[..., 2 * inner:], hd)
    else:
        mlp = block.act_mlp(proj[:, 3 * inner:])

    # Keys/values of cached tokens projected from their cached input rows (y mode), for all such rows at once.
    y_rows = [j for j, vw in enumerate(views) if vw.modes[b] == Y]
    ku = vu = None
    if y_rows:
        xu = torch.cat([hidden[rows[j], views[j].idx_u] for j in y_rows], 0)
        nu = [int(views[j].idx_u.numel()) for j in y_rows]
        nxu = norm(xu) * (1 + _per_token(scale, y_rows, nu)) + _per_token(shift, y_rows, nu)
        with delta.owners(delta.batch_rows([rows[j] for j in y_rows], hidden.shape[0], nu)):
            kvu = fused(nxu, slice(inner, 3 * inner), slice(1, 3))  # to_k, to_v
        ku = attn.norm_k(_heads(kvu[:, :inner], hd)).split(nu)
        vu = _heads(kvu[:, inner:], hd).split(nu)

    H = v.shape[1]
    outs = []
    recorded_kv = {}  # row -> (keys, values) of its image tokens, for a recording row in the gathered path
    patch_kv = {}  # row -> (keys, values) of the tokens it heals
    offs = np.cumsum([0] + counts)
    for j, (i, vw) in enumerate(zip(rows, views)):
        s0, s1 = int(offs[j]), int(offs[j + 1])
        _, pos_tc, cs = gat[j]  # cos/sin at [text; computed] positions, once per request and step
        if dual:
            qk_r = apply_rotary_emb(torch.cat([tqk[j:j + 1], qk[None, s0:s1]], 1), cs, sequence_dim=1)
            v_tc = torch.cat([tv[j:j + 1], v[None, s0:s1]], 1)
        else:
            qk_r = apply_rotary_emb(qk[None, s0:s1], cs, sequence_dim=1)
            v_tc = v[None, s0:s1]
        q_r, k_tc = qk_r[:, :, :H], qk_r[:, :, H:]
        mode = vw.modes[b]
        if vw.patch is not None and mode in (Y, KV) and vw.patch.wants_kv(b):
            patch_kv[j] = (k_tc[0, L + vw.patch_pos], v_tc[0, L + vw.patch_pos])
        if mode in (NOCTX, FULL):  # full: every image token is among the computed ones, so this is exact
            keys, vals = k_tc, v_tc
            if vw.recorder is not None and vw.recorder.wants_kv(b):
                recorded_kv[j] = (k_tc[0, L:], v_tc[0, L:])
        else:
            # One (1, L+N, H, hd) buffer per tensor: text rows, computed rows and cached rows written in place.
            if mode == KV:  # the loader already filled the image part with cached, rotary-applied keys/values
                keys, vals = vw.rows(b, "kbuf"), vw.rows(b, "vbuf")
            else:
                n_r = vw.n_image(N)
                keys, vals = v.new_empty((1, L + n_r, H, hd)), v.new_empty((1, L + n_r, H, hd))
                jj = y_rows.index(j)
                keys[:, L + vw.idx_u] = apply_rotary_emb(ku[jj][None], vw.rope_u(rope, L), sequence_dim=1)
                vals[:, L + vw.idx_u] = vu[jj][None]
            keys[:, pos_tc], vals[:, pos_tc] = k_tc, v_tc
        outs.append(_sdpa(q_r, keys, vals)[0])

    if dual:
        txt_o = torch.stack([o[:L] for o in outs])  # (R, L, inner)
        img_o = torch.cat([o[L:] for o in outs], 0)  # (sum c, inner)
        with delta.owners(per_token):
            xi = x + E(gate) * attn.to_out[0](img_o)
            n2 = block.norm2(xi) * (1 + E(scale_m)) + E(shift_m)
            xi = xi + E(gate_m) * block.ff(n2)
        c_shift, c_scale, c_gate, c_shift_m, c_scale_m, c_gate_m = cmods
        with delta.owners(per_row):
            xt = enc[sel] + c_gate[:, None] * attn.to_add_out(txt_o)
            n2c = block.norm2_context(xt) * (1 + c_scale_m[:, None]) + c_shift_m[:, None]
            xt = xt + c_gate_m[:, None] * block.ff_context(n2c)
        if xt.dtype == torch.float16:  # as FluxTransformerBlock clips its text stream in fp16
            xt = xt.clip(-65504, 65504)
        img_chunks = xi.split(counts_c)
        txt_rows = list(xt)
    else:
        h = torch.cat([torch.cat(outs, 0), mlp], dim=1)
        with delta.owners(per_token):
            xs = x + E(gate) * block.proj_out(h)
        if xs.dtype == torch.float16:  # as FluxSingleTransformerBlock clips its output in fp16
            xs = xs.clip(-65504, 65504)
        chunks = xs.split(counts)
        txt_rows = [c[:L] for c in chunks]
        img_chunks = [c[L:] for c in chunks]

    for j, (i, vw) in enumerate(zip(rows, views)):
        out_txt[i] = txt_rows[j]
        if vw.modes[b] == FULL:  # the gathered path of a packed call: the row's tokens are a prefix
            out_img[i, :counts_c[j]] = img_chunks[j]
            if vw.recorder is not None:
                vw.recorder.put_y(b, img_chunks[j])
                if j in recorded_kv:
                    vw.recorder.put_kv(b, *recorded_kv[j])
            continue
        if vw.patch is not None:
            vw.patch.put_y(b, img_chunks[j][vw.patch_pos])
            if j in patch_kv:
                vw.patch.put_kv(b, *patch_kv[j])
        if vw.needs_output[b]:
            out_img[i, :vw.n_image(N)] = vw.rows(b, "y")  # every row from the store; computed rows overwritten below
        elif out_img is not hidden:
            out_img[i] = hidden[i]  # cached rows are not read by the next (kv) block; keep the buffer defined
        out_img[i, cols[j]] = img_chunks[j]
