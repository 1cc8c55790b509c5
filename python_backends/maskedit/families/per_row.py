"""Per-request layers called once per batch row, so a batched call equals the stock one-request call bit for bit.

A transformer's timestep embedding and modulation layers see (B, D) inputs. A CPU BLAS computes one row (a GEMV)
and several rows (a GEMM) with different summation orders, so a batched call would differ from the stock pipeline's
one-request call in the last bit. Calling these layers per row costs a few tiny GEMVs per step. Used by families
whose requests share a denoiser call (``qwen_image_edit``; ``flux2_klein`` has its own copy of this hook).
"""

from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..adapters import delta


class PerRow(ModelHook):
    """Calls the module once per batch row of its first tensor argument (plain batch-1 calls are unchanged)."""

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or first.ndim == 0 or first.shape[0] <= 1:
            return forward(*args, **kwargs)
        row = lambda a, i: a[i:i + 1] if isinstance(a, torch.Tensor) and a.ndim > 0 else a  # noqa: E731
        out = []
        for i in range(first.shape[0]):
            with delta.owners(delta.batch_rows([i], first.shape[0])):  # an adapter on these layers: row i's
                out.append(forward(*[row(a, i) for a in args], **{k: row(v, i) for k, v in kwargs.items()}))
        return torch.cat(out)


def attach(model, modules, name: str) -> None:
    """``PerRow`` on each of ``modules`` (once per ``model``: the flag ``name`` marks it done)."""
    if getattr(model, name, False):
        return
    for m in modules:
        HookRegistry.check_if_exists_or_initialize(m).register_hook(PerRow(), name)
    object.__setattr__(model, name, True)
