"""Per-request layers called one batch row at a time, so a batched denoiser call equals the stock one-request call
bit for bit on the CPU: the timestep/guidance embedding and the modulation layers see (B, D) inputs, and a CPU BLAS
computes one row (a GEMV) and several rows (a GEMM) with different summation orders. Per row costs a few tiny GEMVs
per step. Shared by the families whose stock pipelines run one request per call (FLUX.2 [klein], FLUX.1 Kontext,
Qwen-Image-Edit)."""

from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..adapters import delta

HOOK = "maskedit_per_row"


class PerRow(ModelHook):
    """Calls the module once per batch row of its first tensor argument (plain batch-1 calls are unchanged)."""

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or first.ndim == 0 or first.shape[0] <= 1:
            return forward(*args, **kwargs)
        row = lambda a, i: a[i:i + 1] if isinstance(a, torch.Tensor) and a.ndim > 0 else a  # noqa: E731
        out = []
        for i in range(first.shape[0]):
            with delta.owners(delta.row_of(i, first.shape[0])):  # an adapter on these layers: row i's request
                out.append(forward(*[row(a, i) for a in args], **{k: row(v, i) for k, v in kwargs.items()}))
        return torch.cat(out)


def per_row(model, modules) -> None:
    """Attach ``PerRow`` to ``modules`` of ``model`` (once per model)."""
    if getattr(model, "_maskedit_per_row", False):
        return
    for m in modules:
        HookRegistry.check_if_exists_or_initialize(m).register_hook(PerRow(), HOOK)
    object.__setattr__(model, "_maskedit_per_row", True)
