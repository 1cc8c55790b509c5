"""Unmerged low-rank deltas on a shared batch: a Diffusers hook on each projection an adapter targets adds
``B(A(x))·scaling`` for the rows whose request carries that adapter, grouped by adapter (Punica / S-LoRA style:
one gather, two small GEMMs and one scatter per adapter and projection; none when every row shares it). Base weights
are never touched; with no plan active (a batch without adapters) the hook only calls the layer. A call whose
requests all carry one set may run projections with merged weights instead (``merge``).

The plan is per thread and per denoiser call: ``active(plan)`` around the call. Batch rows map to requests in
order, ``k = rows // requests`` consecutive rows each (a UNet's classifier-free guidance doubles them)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from .convert import LoadedAdapter

HOOK_NAME = "maskedit_lora_delta"
_local = threading.local()


class BatchPlan:
    """Which adapters (and weights) each request of one denoiser call carries."""

    def __init__(self, per_request: list[tuple[tuple[LoadedAdapter, float], ...]]):
        self.n = len(per_request)
        groups: dict[int, tuple[LoadedAdapter, list[int], list[float]]] = {}
        for j, sets in enumerate(per_request):
            for adapter, weight in sets:
                g = groups.setdefault(id(adapter), (adapter, [], []))
                g[1].append(j)
                g[2].append(float(weight))
        # each adapter once, in the order requests name them (PEFT adds active adapters in set_adapters' order)
        self.groups = list(groups.values())
        self._rows: dict = {}

    def _index(self, jobs: tuple[int, ...], k: int, device) -> torch.Tensor:
        key = (jobs, k, str(device))
        if key not in self._rows:
            self._rows[key] = torch.tensor([j * k + t for j in jobs for t in range(k)], device=device)
        return self._rows[key]

    def weight(self, name: str, module, x: torch.Tensor) -> torch.Tensor | None:
        """A merged weight to run the projection with instead (``merge.MergedPlan``); None: add the deltas."""
        return None

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows % self.n:
            raise RuntimeError(f"LoRA delta at {name}: {rows} batch rows for {self.n} requests")
        k = rows // self.n
        dtype = out.dtype
        for adapter, jobs, weights in self.groups:
            m = adapter.modules.get(name)
            if m is None:
                continue
            xa = x.to(m.A.dtype)
            if len(jobs) == self.n and len(set(weights)) == 1:  # every row: no gather, PEFT's own expression
                out = out + F.linear(F.linear(xa, m.A), m.B) * m.scaling(weights[0])
                continue
            idx = self._index(tuple(jobs), k, x.device)
            d = F.linear(F.linear(xa[idx], m.A), m.B)
            s = torch.tensor([m.scaling(w) for w in weights for _ in range(k)], device=d.device, dtype=d.dtype)
            out = out.index_add(0, idx, d * s.view(-1, *([1] * (d.ndim - 1))))
        return out.to(dtype)


class LoraDeltaHook(ModelHook):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def new_forward(self, module, x, *args, **kwargs):
        plan = getattr(_local, "plan", None)
        if plan is not None and (w := plan.weight(self.name, module, x)) is not None:
            return F.linear(x, w, module.bias)  # the merged path (``merge``): the base weight is only read
        out = self.fn_ref.original_forward(x, *args, **kwargs)
        return out if plan is None else plan.apply(self.name, x, out)


_attach_lock = threading.Lock()


def attach(denoiser, adapter: LoadedAdapter) -> None:
    """Put the delta hook on every projection ``adapter`` targets (once per projection, shared by adapters)."""
    with _attach_lock:
        hooked = denoiser.__dict__.setdefault("_maskedit_lora_hooked", set())
        for name in adapter.modules:
            if name not in hooked:
                HookRegistry.check_if_exists_or_initialize(denoiser.get_submodule(name)).register_hook(
                    LoraDeltaHook(name), HOOK_NAME)
                hooked.add(name)


def detach(denoiser) -> None:
    with _attach_lock:
        for name in denoiser.__dict__.pop("_maskedit_lora_hooked", set()):
            HookRegistry.check_if_exists_or_initialize(denoiser.get_submodule(name)).remove_hook(
                HOOK_NAME, recurse=False)


@contextmanager
def active(plan: BatchPlan | None):
    """``plan`` applies to the denoiser calls this thread makes inside the block."""
    prev = getattr(_local, "plan", None)
    _local.plan = plan
    try:
        yield
    finally:
        _local.plan = prev
