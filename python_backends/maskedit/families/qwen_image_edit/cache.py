"""Mask-aware computation of Qwen-Image transformer blocks, in the contract of ``maskedit.cache.flux``.

Same ``StepContext`` and modes (``maskedit.cache.modes``), ``RowView`` / ``Recorder`` and the runtime's hook methods
(``maskedit.cache.rows.TokenRowHooks``: every block dual-stream), so ``maskedit.cache.runtime.CacheRuntime`` drives
these hooks unchanged.

Every block is an MMDiT block: an image stream and a text stream, each with its own modulation, norms and MLP, and
one joint attention over ``[text; image]``. The image stream holds the N *noisy* tokens (rotary frame 0 of the
image rotary table), then the N *reference* tokens, the template's latents the pipeline appends (rotary frame 1).
The cache addresses the whole image stream: the reference tokens are *reference rows* (``reference_tokens``,
docs/caching.md "Reference rows"), recorded and reused like unmasked noisy ones, so entries hold 2N rows per block,
``idx_c`` / ``idx_u`` index ``[noisy; reference]`` (keys / values recorded with rotary at their image row) and a hit
computes the text and its masked noisy tokens only.

Per row and block (mode of that block for that request):
- ``full``: the block's own forward (a recording row also records every image-stream row and its keys/values);
- ``y``: text and computed tokens go through the block; keys/values of cached tokens (noisy and reference) are
  projected from their cached input rows; their output rows come from the entry;
- ``kv``: as ``y``, keys/values of cached tokens from the entry;
- ``noctx``: computed tokens attend to the text and to each other only.
Attention keys keep the full sequence's order (text, noisy 0..N-1, reference 0..N-1), so a hit on the recording
request's own mask reproduces the template run bit for bit in float32 on the CPU (tested). Packed (mixed
resolution) calls and padded text (``encoder_hidden_states_mask``) are not supported: the family groups requests by
resolution and text length.

Temporal reuse (``maskedit.temporal``, the step context's ``temporal``): every block calls ``enter`` / ``exit`` with
the image stream ``[noisy; reference]`` and the text, the residuals cover both (a hit's: its computed noisy tokens,
its reference rows from its entry), and rows that skip a middle block pass it through unchanged. It applies to the
calls ``run`` wraps: the prompt's, and the negative prompt's of true classifier-free guidance with that stream's own
temporal call (``ctx.temporal.negative()``: plain rows, its own residuals and decisions).
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from ...adapters import delta
from ...cache.modes import FULL, KV, NOCTX, Y, index
from ...cache.rows import RowView, TokenRowHooks

HOOK_NAME = "maskedit_masked_block"
_ARGS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb", "image_rotary_emb",
         "joint_attention_kwargs", "modulate_index")


class QwenEditCacheHooks(TokenRowHooks):
    """The masked-block hooks on a ``QwenImageTransformer2DModel`` (dual-stream blocks only)."""

    HOOK_NAME = HOOK_NAME

    def __init__(self, transformer):
        self.n_dual = len(transformer.transformer_blocks)
        self._attach(transformer, list(transformer.transformer_blocks), QwenBlockHook)

    @property
    def dim(self) -> int:
        return self.transformer.inner_dim

    def text_len(self, x) -> int:
        """The prompt's rows (PROMPT_EMBEDS may also hold a negative prompt's, which the cache never serves)."""
        return int(x.pooled_embeds[0])

    def reference_tokens(self, x) -> int:
        """The template's N latents ride along as reference tokens."""
        return int(x.latents.shape[0])

    def check(self, spec) -> str | None:
        """Why this model cannot serve temporal reuse (``maskedit.temporal.admit``): a reused step's rows take the
        hooks' own path, which a zero_cond_t model (per-token modulation) does not take."""
        if getattr(self.transformer.config, "zero_cond_t", False):
            return "zero_cond_t Qwen-Image models do not serve temporal reuse yet; leave TEMPORAL out"
        return None


class QwenBlockHook(ModelHook):
    def __init__(self, owner: QwenEditCacheHooks, index: int):
        super().__init__()
        self.owner, self.index = owner, index

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        a = dict(zip(_ARGS, args), **kwargs)
        ctx = self.owner.context
        if ctx is not None and ctx.on_block is not None:
            ctx.on_block(self.index)
        tp = ctx.temporal if ctx is not None else None  # temporal reuse (``maskedit.temporal``)
        if tp is not None:  # its residuals cover the image stream (noisy then reference tokens) and the text
            tp.enter(ctx, self.index, a["hidden_states"], a["encoder_hidden_states"])
        skip = ctx.skipped(self.index) if ctx is not None else []
        if ctx is None or (not skip and all(r is None or (r.all_full and r.recorder is None) for r in ctx.rows)):
            res = forward(*args, **kwargs)
            if tp is not None:
                tp.exit(ctx, self.index, res[1], res[0])
            return res
        if ctx.packed:
            raise NotImplementedError("qwen_image_edit: packed (mixed-resolution) calls are not supported")
        if a.get("encoder_hidden_states_mask") is not None or a.get("modulate_index") is not None:
            raise NotImplementedError("qwen_image_edit: padded text and zero_cond_t models take no cached path")
        b = self.index
        hidden, enc, temb = a["hidden_states"], a["encoder_hidden_states"], a["temb"]
        n = hidden.shape[1]  # the image stream: noisy then reference tokens, the rows an entry holds
        full_rows = [i for i, r in enumerate(ctx.rows) if (r is None or r.modes[b] == FULL) and i not in skip]
        masked_rows = [i for i in range(len(ctx.rows)) if i not in full_rows and i not in skip]
        out = torch.empty_like(hidden) if full_rows else hidden  # no full rows: the input buffer becomes the output
        out_txt = torch.empty_like(enc)
        batch = hidden.shape[0]
        for i in skip:  # a reused middle block: the row passes through (its residual is added at the last one)
            if out is not hidden:
                out[i] = hidden[i]
            out_txt[i] = enc[i]
        if full_rows:
            sel = index(full_rows, hidden.device)
            with delta.owners(delta.batch_rows(full_rows, batch)):  # adapters' rows: these requests'
                t, h = forward(hidden_states=hidden[sel], encoder_hidden_states=enc[sel],
                               encoder_hidden_states_mask=None, temb=temb[sel], image_rotary_emb=a["image_rotary_emb"],
                               joint_attention_kwargs=a.get("joint_attention_kwargs"))
            out_txt[sel], out[sel] = t, h
            for j, i in enumerate(full_rows):
                rec = ctx.rows[i].recorder if ctx.rows[i] is not None else None
                if rec is None:
                    continue
                rec.put_y(b, h[j])
                if rec.wants_kv(b):
                    with delta.owners(delta.batch_rows([i], batch)):
                        k, v = image_kv(module, hidden[i:i + 1], temb[i:i + 1], a["image_rotary_emb"],
                                        torch.arange(n, device=hidden.device))
                    rec.put_kv(b, k[0], v[0])
        for i in masked_rows:
            with delta.owners(delta.batch_rows([i], batch)):  # every layer below sees this one row
                masked_row(module, b, ctx.rows[i], hidden[i:i + 1], enc[i:i + 1], temb[i:i + 1],
                           a["image_rotary_emb"], out, out_txt, i, in_place=not full_rows)
        if tp is not None:
            tp.exit(ctx, b, out, out_txt)
        return out_txt, out


# ---------------------------------------------------------------------------------------------------------------
# The math: QwenImageTransformerBlock.forward with QwenDoubleStreamAttnProcessor2_0 (diffusers 0.42) on gathered
# image tokens, the steps written as they are there.

def _heads(attn, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, attn.inner_dim // attn.heads))


def _image_in(block, x: torch.Tensor, temb: torch.Tensor):
    """The block's modulated pre-attention norm of image tokens ``x`` (1, n, D), its gate, and the second
    modulation's parameters."""
    mod1, mod2 = block.img_mod(temb).chunk(2, dim=-1)
    normed, gate = block._modulate(block.img_norm1(x), mod1)
    return normed, gate, mod2


def _kv(attn, normed: torch.Tensor, freqs: torch.Tensor):
    """Keys (normed, rotary at ``freqs``) and values of image tokens."""
    k = _heads(attn, attn.to_k(normed))
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    return apply_rotary_emb_qwen(k, freqs, use_real=False), _heads(attn, attn.to_v(normed))


def image_kv(block, x: torch.Tensor, temb: torch.Tensor, rope, rows: torch.Tensor):
    """Keys (rotary applied) and values of the image-stream tokens ``x`` (1, n, D) at image rows ``rows``."""
    normed, _, _ = _image_in(block, x, temb)
    return _kv(block.attn, normed, rope[0][rows])


def _attention(attn, q, k, v):
    """The joint attention as the processor computes it (``dispatch_attention_fn``, its backend)."""
    proc = attn.processor
    o = dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                              backend=getattr(proc, "_attention_backend", None),
                              parallel_config=getattr(proc, "_parallel_config", None))
    return o.flatten(2, 3).to(q.dtype)


def masked_row(block, b: int, vw: RowView, hidden, enc, temb, rope, out, out_txt, i: int, in_place: bool) -> None:
    """Batch row ``i`` (``hidden`` / ``enc`` / ``temb`` its rows) in its cached mode for block ``b``: writes ``out``
    and ``out_txt`` (``in_place``: ``out`` is the block's input buffer)."""
    attn = block.attn
    dev = hidden.device
    n = hidden.shape[1]
    L = enc.shape[1]
    img = vw.idx_c  # the image-stream tokens computed: masked noisy ones (reference rows come from the entry)
    mode = vw.modes[b]
    img_freqs, txt_freqs = rope
    x = hidden[:, img]
    normed, gate1, mod2 = _image_in(block, x, temb)
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
    txt_normed, txt_gate1 = block._modulate(block.txt_norm1(enc), txt_mod1)

    q = _heads(attn, attn.to_q(normed))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    q = apply_rotary_emb_qwen(q, img_freqs[img], use_real=False)
    k, v = _kv(attn, normed, img_freqs[img])
    tq, tk, tv = (_heads(attn, p(txt_normed)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    if attn.norm_added_q is not None:
        tq = attn.norm_added_q(tq)
    if attn.norm_added_k is not None:
        tk = attn.norm_added_k(tk)
    tq = apply_rotary_emb_qwen(tq, txt_freqs, use_real=False)
    tk = apply_rotary_emb_qwen(tk, txt_freqs, use_real=False)
    if mode == NOCTX:
        keys, vals = torch.cat([tk, k], dim=1), torch.cat([tv, v], dim=1)
    elif mode in (Y, KV):
        keys, vals = k.new_empty((1, L + n) + k.shape[2:]), v.new_empty((1, L + n) + v.shape[2:])
        u = vw.idx_u + L
        if mode == KV:  # the loader's buffers hold the recorded keys/values (rotary applied) of every cached token
            keys[:, u], vals[:, u] = vw.rows(b, "kbuf")[:, u], vw.rows(b, "vbuf")[:, u]
        else:  # projected from the cached tokens' input rows
            keys[:, u], vals[:, u] = image_kv(block, hidden[:, vw.idx_u], temb, rope, vw.idx_u)
        keys[:, :L], vals[:, :L] = tk, tv
        keys[:, img + L], vals[:, img + L] = k, v
    else:
        raise ValueError(f"mode {mode!r} in the gathered path")
    o = _attention(attn, torch.cat([tq, q], dim=1), keys, vals)
    if vw.patch is not None and vw.patch.wants_kv(b):
        vw.patch.put_kv(b, k[0, vw.patch_pos], v[0, vw.patch_pos])
    img_o = attn.to_out[0](o[:, L:].contiguous())
    if len(attn.to_out) > 1:
        img_o = attn.to_out[1](img_o)  # dropout
    txt_o = attn.to_add_out(o[:, :L].contiguous())
    xi = x + gate1 * img_o
    xt = enc + txt_gate1 * txt_o
    n2, gate2 = block._modulate(block.img_norm2(xi), mod2)
    xi = xi + gate2 * block.img_mlp(n2)
    n2t, txt_gate2 = block._modulate(block.txt_norm2(xt), txt_mod2)
    xt = xt + txt_gate2 * block.txt_mlp(n2t)
    if xt.dtype == torch.float16:
        xt = xt.clip(-65504, 65504)
    if xi.dtype == torch.float16:
        xi = xi.clip(-65504, 65504)
    out_txt[i] = xt[0]
    if vw.patch is not None:
        vw.patch.put_y(b, xi[0, vw.patch_pos])
    if vw.needs_output[b]:
        out[i] = vw.rows(b, "y")  # cached rows from the entry; computed ones overwritten below
    elif not in_place:
        out[i] = hidden[0]  # cached rows are not read by the next (kv) block; keep the buffer defined
    out[i, img] = xi[0]
