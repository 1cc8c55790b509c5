"""The masked computation of one SD 2 / SDXL ``BasicTransformerBlock`` for a step's cached rows
(``masked_unet_block``), called by the hooks in ``cache``.

It mirrors BasicTransformerBlock.forward (norm_type "layer_norm", no positional embedding, self- then
cross-attention then feed-forward) and AttnProcessor2_0 in diffusers 0.37 on gathered tokens; tests check it
against the block's own forward.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...adapters import delta
from ...cache.modes import KV, NOCTX, Y
from ...cache.modes import index as _index
from .rows import UNetRowView


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
