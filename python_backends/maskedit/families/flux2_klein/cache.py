"""Mask-aware computation of FLUX.2 [klein] transformer blocks, in the contract of ``maskedit.families.flux_fill.cache``.

Same ``StepContext`` and modes (``maskedit.cache.modes``), ``RowView`` / ``Recorder`` and the runtime's hook
methods (``maskedit.cache.rows.TokenRowHooks``: kinds from ``n_dual``, width, heads), so
``maskedit.cache.runtime.CacheRuntime`` drives these hooks unchanged.

The sequence differs from Flux Fill's: text, then the N noisy image tokens, then the *reference* tokens (the
template's clean latents, N of them, and any further reference images'; appended by the pipeline, the mask is not a
model input). The cache addresses every token after the text (``reference_tokens``: the reference rows, recorded and
reused like unmasked noisy ones, docs/caching.md "Reference rows"): entries hold N + R rows per block, ``idx_c`` /
``idx_u`` index the image stream ``[noisy; reference]`` and keys/values are recorded with rotary at sequence
position ``L + i``. A hit computes the text and its masked noisy tokens only.

Per row and block (mode of that block for that request):
- ``full``: the block's own forward (a recording row also records every image-stream row and its keys/values);
- ``y``: text and computed tokens go through the block; keys/values of cached tokens (noisy and reference) are
  projected from their cached input rows; their output rows come from the entry;
- ``kv``: as ``y``, keys/values of cached tokens from the entry;
- ``noctx``: computed tokens attend to the text and to each other only.
Attention keys keep the full sequence's order (text, noisy 0..N-1, reference 0..R-1), so a hit on the recording
request's own mask reproduces the template run bit for bit in float32 on the CPU (tested). Packed (mixed
resolution) calls are not supported: the family groups requests by resolution and references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import Flux2Modulation, Flux2TransformerBlock

from ...adapters import delta
from ...cache.modes import FULL, KV, NOCTX, Y, StepContext  # noqa: F401  (the shared contract)
from ...cache.rows import Recorder, RowView, TokenRowHooks  # noqa: F401

HOOK_NAME = "maskedit_masked_block"
_DUAL_ARGS = ("hidden_states", "encoder_hidden_states", "temb_mod_img", "temb_mod_txt", "image_rotary_emb",
              "joint_attention_kwargs")
_SINGLE_ARGS = ("hidden_states", "encoder_hidden_states", "temb_mod", "image_rotary_emb", "joint_attention_kwargs",
                "split_hidden_states", "text_seq_len")


class Flux2KleinCacheHooks(TokenRowHooks):
    """The masked-block hooks on a ``Flux2Transformer2DModel`` (double-stream blocks, then single-stream)."""

    HOOK_NAME = HOOK_NAME

    def __init__(self, transformer):
        self.n_dual = len(transformer.transformer_blocks)
        self._attach(transformer, list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks),
                     KleinBlockHook)

    @property
    def dim(self) -> int:
        return self.transformer.inner_dim

    def reference_tokens(self, x) -> int:
        """The template's N latents ride along as reference tokens, then any further reference images' tokens."""
        extra = getattr(x, "reference", None)
        return int(x.latents.shape[0]) + (0 if extra is None else int(extra.shape[0]))

    def call_text_len(self) -> int:
        """Text tokens of the call in progress (set by the first double-stream block: single-stream blocks get text
        and image as one sequence)."""
        return self._local.text_len


class KleinBlockHook(ModelHook):
    def __init__(self, owner: Flux2KleinCacheHooks, index: int):
        super().__init__()
        self.owner, self.index = owner, index

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        dual = isinstance(module, Flux2TransformerBlock)
        a = dict(zip(_DUAL_ARGS if dual else _SINGLE_ARGS, args), **kwargs)
        if dual:
            self.owner._local.text_len = a["encoder_hidden_states"].shape[1]
        ctx = self.owner.context
        if ctx is not None and ctx.on_block is not None:
            ctx.on_block(self.index)
        tp = ctx.temporal if ctx is not None else None  # temporal reuse (``maskedit.temporal``)
        L = self.owner.call_text_len() if tp is not None else 0
        # its residuals cover the image stream (noisy then reference tokens) and the text, whatever the block's layout
        parts = (lambda h, t: (h, t)) if dual else (lambda h, t: (h[:, L:], h[:, :L]))
        if tp is not None:
            tp.enter(ctx, self.index, *parts(a["hidden_states"], a.get("encoder_hidden_states")))
        skip = ctx.skipped(self.index) if ctx is not None else []
        if ctx is None or (not skip and all(r is None or (r.all_full and r.recorder is None) for r in ctx.rows)):
            res = forward(*args, **kwargs)
            if tp is not None:
                tp.exit(ctx, self.index, *((res[1], res[0]) if dual else parts(res, None)))
            return res
        if ctx.packed:
            raise NotImplementedError("flux2_klein: packed (mixed-resolution) calls are not supported")
        if not dual and (a.get("encoder_hidden_states") is not None or a.get("split_hidden_states")):
            raise NotImplementedError("flux2_klein: single-stream blocks are called with one joined sequence")
        b = self.index
        hidden, rope = a["hidden_states"], a["image_rotary_emb"]
        L = self.owner.call_text_len()
        full_rows = [i for i, r in enumerate(ctx.rows) if (r is None or r.modes[b] == FULL) and i not in skip]
        masked_rows = [i for i in range(len(ctx.rows)) if i not in full_rows and i not in skip]
        out = torch.empty_like(hidden) if full_rows else hidden  # no full rows: the input buffer becomes the output
        out_txt = torch.empty_like(a["encoder_hidden_states"]) if dual else None
        batch = hidden.shape[0]
        for i in skip:  # a reused middle block: the row passes through (its residual is added at the last one)
            if out is not hidden:
                out[i] = hidden[i]
            if dual:
                out_txt[i] = a["encoder_hidden_states"][i]
        if full_rows:
            sel = torch.tensor(full_rows, device=hidden.device)
            with delta.owners(delta.batch_rows(full_rows, batch)):  # adapters' rows: these requests'
                if dual:
                    t, h = forward(hidden_states=hidden[sel], encoder_hidden_states=a["encoder_hidden_states"][sel],
                                   temb_mod_img=_rows(a["temb_mod_img"], sel),
                                   temb_mod_txt=_rows(a["temb_mod_txt"], sel), image_rotary_emb=rope,
                                   joint_attention_kwargs=a.get("joint_attention_kwargs"))
                    out_txt[sel], out[sel] = t, h
                else:
                    h = forward(hidden_states=hidden[sel], encoder_hidden_states=None,
                                temb_mod=_rows(a["temb_mod"], sel), image_rotary_emb=rope,
                                joint_attention_kwargs=a.get("joint_attention_kwargs"))
                    out[sel] = h
            for j, i in enumerate(full_rows):
                rec = ctx.rows[i].recorder if ctx.rows[i] is not None else None
                if rec is None:
                    continue
                rec.put_y(b, h[j] if dual else h[j, L:])
                if rec.wants_kv(b):
                    with delta.owners(delta.batch_rows([i], batch)):
                        k, v = image_kv(module, dual, hidden[i:i + 1], a, i, rope, L)
                    rec.put_kv(b, k[0], v[0])
        for i in masked_rows:
            with delta.owners(delta.batch_rows([i], batch)):  # every layer below sees this one row
                masked_row(module, dual, b, i, ctx.rows[i], hidden, a, rope, L, out, out_txt)
        if tp is not None:
            tp.exit(ctx, b, *((out, out_txt) if dual else parts(out, None)))
        return (out_txt, out) if dual else out


# ---------------------------------------------------------------------------------------------------------------
# The math: Flux2TransformerBlock.forward / Flux2SingleTransformerBlock.forward with Flux2AttnProcessor /
# Flux2ParallelSelfAttnProcessor (diffusers 0.42) on gathered tokens, element-wise steps written as they are there.

def _rows(mod: torch.Tensor, sel) -> torch.Tensor:
    return mod[sel] if mod.shape[0] > 1 else mod.expand(len(sel), *mod.shape[1:])


def _row(mod: torch.Tensor, i: int) -> torch.Tensor:
    return mod[i:i + 1] if mod.shape[0] > 1 else mod


def _n_image(hidden: torch.Tensor, L: int, dual: bool) -> int:
    """Tokens of the image stream (the noisy tokens, then the reference tokens): the rows an entry holds."""
    return hidden.shape[1] if dual else hidden.shape[1] - L


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, hd))


def _sdpa(q, k, v):
    """(1, S, H, hd) in, (1, S, H*hd) out, as ``dispatch_attention_fn``'s native backend computes it."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2, 3).to(q.dtype)


def _norm_in(block, dual: bool, a: dict, i: int, x: torch.Tensor) -> torch.Tensor:
    """The block's modulated pre-attention norm of ``x`` (1, n, D) for batch row ``i``."""
    if dual:
        (shift, scale, _), _ = Flux2Modulation.split(_row(a["temb_mod_img"], i), 2)
        return (1 + scale) * block.norm1(x) + shift
    shift, scale, _ = Flux2Modulation.split(_row(a["temb_mod"], i), 1)[0]
    return (1 + scale) * block.norm(x) + shift


def _kv(block, dual: bool, normed: torch.Tensor):
    """Keys (normed, before rotary) and values of ``normed`` tokens."""
    attn = block.attn
    hd = attn.head_dim
    if dual:
        return attn.norm_k(_heads(attn.to_k(normed), hd)), _heads(attn.to_v(normed), hd)
    inner = attn.inner_dim
    proj = attn.to_qkv_mlp_proj
    kv = F.linear(normed, proj.weight[inner:3 * inner], None if proj.bias is None else proj.bias[inner:3 * inner])
    kv = delta.add(proj, normed, kv, part=slice(inner, 3 * inner))  # the adapters' share of those features
    return attn.norm_k(_heads(kv[..., :inner], hd)), _heads(kv[..., inner:], hd)


def image_kv(block, dual: bool, hidden: torch.Tensor, a: dict, i: int, rope, L: int):
    """Keys (rotary applied) and values of every image-stream token (noisy and reference) of batch row ``i``
    (``hidden`` its (1, S, D))."""
    n = _n_image(hidden, L, dual)
    x = hidden[:, :n] if dual else hidden[:, L:L + n]
    k, v = _kv(block, dual, _norm_in(block, dual, a, i, x))
    pos = torch.arange(n, device=hidden.device) + L
    return apply_rotary_emb(k, (rope[0][pos], rope[1][pos]), sequence_dim=1), v


def masked_row(block, dual: bool, b: int, i: int, vw: RowView, hidden, a: dict, rope, L: int, out, out_txt):
    """Batch row ``i`` in its cached mode for block ``b``: writes ``out`` (and ``out_txt`` for a dual block)."""
    attn = block.attn
    hd = attn.head_dim
    dev = hidden.device
    n = _n_image(hidden, L, dual)
    img, pos, cs = vw.gathered(b, L, rope, n, dev)  # the computed image-stream tokens; [text; those] positions
    mode = vw.modes[b]
    x = hidden[i:i + 1, img] if dual else hidden[i:i + 1, pos]  # dual: image stream only; single: [text; computed]
    normed = _norm_in(block, dual, a, i, x)
    if dual:
        q = attn.norm_q(_heads(attn.to_q(normed), hd))
        k = attn.norm_k(_heads(attn.to_k(normed), hd))
        v = _heads(attn.to_v(normed), hd)
        (_, _, gate), (shift_m, scale_m, gate_m) = Flux2Modulation.split(_row(a["temb_mod_img"], i), 2)
        (c_shift, c_scale, c_gate), (c_shift_m, c_scale_m, c_gate_m) = Flux2Modulation.split(
            _row(a["temb_mod_txt"], i), 2)
        e = a["encoder_hidden_states"][i:i + 1]
        ne = (1 + c_scale) * block.norm1_context(e) + c_shift
        q = torch.cat([attn.norm_added_q(_heads(attn.add_q_proj(ne), hd)), q], dim=1)
        k = torch.cat([attn.norm_added_k(_heads(attn.add_k_proj(ne), hd)), k], dim=1)
        v = torch.cat([_heads(attn.add_v_proj(ne), hd), v], dim=1)
    else:
        proj = attn.to_qkv_mlp_proj(normed)
        qkv, mlp = torch.split(proj, [3 * attn.inner_dim, proj.shape[-1] - 3 * attn.inner_dim], dim=-1)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k, v = attn.norm_q(_heads(q, hd)), attn.norm_k(_heads(k, hd)), _heads(v, hd)
        gate = Flux2Modulation.split(_row(a["temb_mod"], i), 1)[0][2]
    q = apply_rotary_emb(q, cs, sequence_dim=1)
    k = apply_rotary_emb(k, cs, sequence_dim=1)
    if mode == NOCTX:
        keys, vals = k, v
    elif mode in (Y, KV):
        if mode == KV:  # the loader's (1, L+n) buffers hold every cached token's recorded keys/values (rotary
            keys, vals = vw.rows(b, "kbuf"), vw.rows(b, "vbuf")  # applied); the computed rows go into them
        else:  # cached tokens' keys/values projected from their input rows
            keys, vals = k.new_empty((1, L + n) + k.shape[2:]), v.new_empty((1, L + n) + v.shape[2:])
            u = vw.idx_u + L
            xu = hidden[i:i + 1, vw.idx_u] if dual else hidden[i:i + 1, u]
            ku, vu = _kv(block, dual, _norm_in(block, dual, a, i, xu))
            keys[:, u], vals[:, u] = apply_rotary_emb(ku, vw.rope_u(rope, L), sequence_dim=1), vu
        keys[:, pos], vals[:, pos] = k, v
    else:
        raise ValueError(f"mode {mode!r} in the gathered path")
    o = _sdpa(q, keys, vals)
    if vw.patch is not None and vw.patch.wants_kv(b):
        vw.patch.put_kv(b, k[0, L + vw.patch_pos], v[0, L + vw.patch_pos])
    if dual:
        xi = x + gate * attn.to_out[0](o[:, L:])
        n2 = block.norm2(xi) * (1 + scale_m) + shift_m
        xi = xi + gate_m * block.ff(n2)
        xt = e + c_gate * attn.to_add_out(o[:, :L])
        n2c = block.norm2_context(xt) * (1 + c_scale_m) + c_shift_m
        xt = xt + c_gate_m * block.ff_context(n2c)
        if xt.dtype == torch.float16:
            xt = xt.clip(-65504, 65504)
        out_txt[i] = xt[0]
        rows, computed_out, computed = img, xi[0], xi[0]
        start = 0
    else:
        h = torch.cat([o, attn.mlp_act_fn(mlp)], dim=-1)
        xs = x + gate * attn.to_out(h)
        if xs.dtype == torch.float16:
            xs = xs.clip(-65504, 65504)
        rows, computed_out, computed = pos, xs[0], xs[0, L:]
        start = L
    if vw.patch is not None:
        vw.patch.put_y(b, computed[vw.patch_pos])
    if vw.needs_output[b]:
        out[i, start:start + n] = vw.rows(b, "y")  # cached rows from the entry; computed ones overwritten below
    elif out is not hidden:
        out[i] = hidden[i]  # cached rows are not read by the next (kv) block; keep the buffer defined
    out[i, rows] = computed_out
