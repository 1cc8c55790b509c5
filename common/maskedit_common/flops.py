"""FLOP model of one Flux denoising step: the ideal speedup a masked mode can reach.

Counts multiply-adds x2 of the token-wise projections and of attention (QK^T and AV). Per token, both
block kinds do 24*D^2 of projections (dual: qkv 6, out 2, MLP 16; single: qkv 6, MLP-in 8, out 10); the
cached tokens of a ``y`` block still pay their key/value projections (4*D^2).
"""

from __future__ import annotations

from .blocks import FULL, KV, Y


def block_flops(mode: str, dual: bool, n: int, c: int, text: int, dim: int) -> float:
    """FLOPs of one block with ``n`` image tokens of which ``c`` are computed."""
    d2 = dim * dim
    if mode == FULL:
        c = n
    u = n - c
    q = text + c  # query rows
    proj = 24 * d2 * (text + c) + (4 * d2 * u if mode == Y else 0)
    attn = 4 * q * (text + n) * dim
    if mode not in (FULL, Y, KV):  # noctx: keys are only the text and the computed rows
        attn = 4 * q * (text + c) * dim
    return float(proj + attn)


def step_flops(modes: list[str], n_dual: int, n: int, c: int, text: int, dim: int, in_channels: int = 64,
               out_channels: int = 64) -> float:
    """``in_channels`` / ``out_channels``: of the x_embedder and proj_out, which run on every token in every mode
    (Flux Fill's x_embedder also reads the mask and masked-image latents: 384 inputs at full size)."""
    edges = 2 * n * dim * in_channels + 2 * n * dim * out_channels
    return edges + sum(block_flops(m, i < n_dual, n, c, text, dim) for i, m in enumerate(modes))


def edges(config) -> dict:
    """The ``in_channels`` / ``out_channels`` keywords for a ``FluxTransformer2DModel`` config."""
    out = config.out_channels or config.in_channels
    return {"in_channels": int(config.in_channels), "out_channels": int(config.patch_size ** 2 * out)}


def ideal_speedup(modes: list[str], n_dual: int, n: int, c: int, text: int, dim: int, **edges) -> float:
    full = step_flops(["full"] * len(modes), n_dual, n, n, text, dim, **edges)
    return full / step_flops(modes, n_dual, n, c, text, dim, **edges)


def unet_block_flops(mode: str, n: int, c: int, text: int, dim: int) -> float:
    """FLOPs of one SD/SDXL ``BasicTransformerBlock`` with ``n`` tokens of which ``c`` are computed: per computed
    token self-attention q/k/v/out (8*D^2), cross-attention q/out (4*D^2), GEGLU feed-forward (24*D^2); attention
    over all ``n`` keys and the ``text`` tokens; ``y`` also projects the cached tokens' keys/values (4*D^2)."""
    d2 = dim * dim
    if mode == FULL:
        c = n
    u = n - c
    keys = c if mode not in (FULL, Y, KV) else n  # noctx: only the computed tokens
    return float(2 * (18 * d2 * c + (2 * d2 * u if mode == Y else 0)) + 4 * c * keys * dim + 4 * c * text * dim)
