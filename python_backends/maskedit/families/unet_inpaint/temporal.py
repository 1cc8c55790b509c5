"""Temporal reuse on SD 2 / SDXL UNets (``maskedit.temporal``): DeepCache's reuse of the deep features, per request.

A UNet's blocks change the tensor's shape (down-sampling, up-sampling, skip connections), so the residual over
middle blocks that DBCache reuses on a transformer is undefined. What fits is DeepCache (Ma et al., 2023): the
high-level features change slowly between steps, the shallow ones do not. The blocks, in execution order, are the
down blocks, the mid block and the up blocks; the first ``fn`` down blocks and the last ``bn`` up blocks always run
(``bn <= fn``: the up blocks that run read the skip connections of the down blocks that ran), and on a reused step
the output of the last middle up block is the one recorded at the request's last computed step (or its TaylorSeer
forecast). A threshold policy decides from the first blocks' output (cache-dit's hidden-states L1 mode).

Per request inside the batch: a block whose rows partly skip runs on the other rows only (the mask-aware block
hooks inside see those rows' views, the adapters those rows' requests), and the skipped rows get zeros of the
block's output shape (read by nothing: the blocks after it up to the last middle one are skipped too). Diffusers 0.42
has no DeepCache hook and cache-dit targets DiTs, so there is no library reference here; the tests hold it to a
plain reference of DeepCache on the stock pipeline's UNet (``tests/unit/maskedit/test_unet_temporal.py``).
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook

from ...adapters import delta
from ...cache.hooks import BlockHooks
from ...cache.modes import StepContext, index
from .cache import UNetCacheHooks
from .prepare import cfg_rows

HOOK_NAME = "maskedit_temporal_unet_block"


class UNetTemporalHooks(BlockHooks):
    """Hooks on a ``UNet2DConditionModel``'s down, mid and up blocks; their context is the call's
    ``TemporalCall``."""

    _ATTR = "_maskedit_temporal_hooks"
    HOOK_NAME = HOOK_NAME
    features = True  # the middle blocks' output itself is reused (``TemporalCall.exit_features``)

    def __init__(self, unet):
        self._attach(unet, list(unet.down_blocks) + [unet.mid_block] + list(unet.up_blocks), UNetTemporalHook)
        self.n_down = len(unet.down_blocks)

    def inner_blocks(self, first: int, tail: int) -> tuple[int, int]:
        """The mask-aware transformer blocks (``UNetCacheHooks`` indices) inside UNet blocks ``first`` … ``tail``."""
        counts = [sum(len(a.transformer_blocks) for a in getattr(blk, "attentions", None) or [])
                  for blk in self.blocks]
        return sum(counts[:first]), sum(counts[:tail + 1]) - 1

    @staticmethod
    def temporal_rows(job) -> int:
        return cfg_rows(job.inputs.guidance)  # a request's guidance rows skip together

    def check(self, spec) -> str | None:
        """Why ``spec`` cannot run on this UNet, or None."""
        if spec.bn > spec.fn:
            return f'"bn" ({spec.bn}) must be at most "fn" ({spec.fn}) on a UNet: its last up blocks read the skip ' \
                   "connections of its first down blocks"
        if spec.fn > self.n_down:
            return f'"fn" must be at most {self.n_down} (the down blocks) on this UNet'
        return None


class UNetTemporalHook(ModelHook):
    def __init__(self, owner: UNetTemporalHooks, index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self._shapes: dict = {}  # input shape (without the batch) -> the output's structure and shapes

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        call = self.owner.context
        if call is None:
            return forward(*args, **kwargs)
        b = self.index
        skip = call.skipped(b)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        batch = hidden.shape[0]
        if not skip:
            out = forward(*args, **kwargs)
        else:
            keep = [i for i in range(batch) if i not in skip]
            out = self._rows(module, forward, args, kwargs, keep, batch, tuple(hidden.shape[1:]))
        if not skip:
            self._shapes[tuple(hidden.shape[1:])] = _structure(out)
        call.exit_features(b, out[0] if isinstance(out, tuple) else out)
        return out

    def _rows(self, module, forward, args, kwargs, keep: list[int], batch: int, key: tuple):
        """The block on batch rows ``keep`` only; zeros of its output's shapes for the others."""
        if not keep:
            return _zeros(self._shapes[key], batch, args, kwargs)
        sel = index(keep, _device(args, kwargs))  # made once per rows and device (no copy per block)
        pick = lambda v: _take(v, sel, batch)  # noqa: E731
        inner = getattr(self.owner.transformer, UNetCacheHooks._ATTR, None)  # the mask-aware block hooks, if on
        ctx = inner.context if inner is not None else None
        if ctx is not None:  # inside, they address these rows only
            inner._local.ctx = StepContext([ctx.rows[i] for i in keep], packed=ctx.packed, on_block=ctx.on_block)
        try:
            with delta.subset(keep, batch):
                part = forward(*[pick(a) for a in args], **{k: pick(v) for k, v in kwargs.items()})
        finally:
            if ctx is not None:
                inner._local.ctx = ctx
        return _scatter(part, sel, batch)


def _device(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device
    return "cpu"


def _take(v, sel, batch: int):
    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
        return v[sel]
    if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
        return tuple(_take(t, sel, batch) for t in v)
    return v


def _scatter(v, sel, batch: int):
    if isinstance(v, torch.Tensor):
        out = v.new_zeros((batch,) + tuple(v.shape[1:]))
        out[sel] = v
        return out
    return tuple(_scatter(t, sel, batch) for t in v)


def _structure(v):
    """The output's nesting and each tensor's (shape without the batch, dtype)."""
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape[1:]), v.dtype)
    return [_structure(t) for t in v]


def _zeros(structure, batch: int, args, kwargs):
    device = _device(args, kwargs)
    if isinstance(structure, tuple):
        shape, dtype = structure
        return torch.zeros((batch,) + shape, dtype=dtype, device=device)
    return tuple(_zeros(s, batch, args, kwargs) for s in structure)
