"""Unmerged low-rank deltas on a shared batch: a Diffusers hook on each projection an adapter targets adds
``B(A(x))·scaling`` for the rows whose request carries that adapter, grouped by adapter and weight (Punica /
S-LoRA style: one gather, two small GEMMs and one scatter per group and projection; none when every row shares
it). Base weights are never touched; with no plan active (a batch without adapters) the hook only calls the layer.
A call whose requests all carry one set may run projections with merged weights instead (``merge``).

The plan is per thread and per denoiser call: ``active(plan)`` around the call. Which request each row of a
layer's input belongs to: by default (the denoiser's own forward over the whole batch) requests in order,
``rows // requests`` consecutive rows each (a UNet's classifier-free guidance doubles them). The mask-aware block
paths (``maskedit.families.*.cache``) call layers on other layouts (a subset of the batch rows, or the computed
tokens of several requests concatenated): they say so with ``owners(segments)``, and add the deltas of
projections they compute with stacked (fused) weights with ``add`` / ``add_fused``."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
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
        groups: dict[tuple[int, float], tuple[LoadedAdapter, float, set[int]]] = {}
        for j, sets in enumerate(per_request):
            for adapter, weight in sets:
                groups.setdefault((id(adapter), float(weight)), (adapter, float(weight), set()))[2].add(j)
        # each (adapter, weight) once, in the order requests name them (PEFT adds active adapters in set_adapters'
        # order)
        self.groups = list(groups.values())
        self._rows: dict = {}
        self._stacks: dict = {}

    def request_of(self, row: int, batch: int) -> int:
        """The request that batch row ``row`` of a ``batch``-row call belongs to."""
        return row // (batch // self.n)

    def _index(self, g: int, segments: tuple, device):
        """Rows of group ``g`` among ``segments`` ((request, rows) runs along dim 0): None (none), "all", a
        ``slice`` (one contiguous run: a view, no gather or scatter) or an index tensor; made once per call and
        layout."""
        key = (g, segments, str(device))
        if key not in self._rows:
            jobs = self.groups[g][2]
            starts = np.cumsum([0] + [c for _, c in segments])
            mine = [(int(s), c) for (r, c), s in zip(segments, starts) if r in jobs and c]
            runs: list[list[int]] = []
            for s, c in mine:  # neighbouring runs of the group merge (a request's rows, CFG's doubled ones)
                if runs and runs[-1][0] + runs[-1][1] == s:
                    runs[-1][1] += c
                else:
                    runs.append([s, c])
            if not runs:
                idx = None
            elif runs[0][1] == int(starts[-1]):
                idx = "all"
            elif len(runs) == 1:
                idx = slice(runs[0][0], runs[0][0] + runs[0][1])
            else:
                idx = torch.from_numpy(np.concatenate([np.arange(s, s + c) for s, c in runs])).to(device)
            self._rows[key] = idx
        return self._rows[key]

    def weight(self, name: str, module, x: torch.Tensor) -> torch.Tensor | None:
        """A merged weight to run the projection with instead (``merge.MergedPlan``); None: add the deltas."""
        return None

    def apply(self, name: str, x: torch.Tensor, out: torch.Tensor, part: slice | None = None,
              inplace: bool = False) -> torch.Tensor:
        """``out`` plus the deltas of layer ``name`` on input ``x`` (``part``: only those output features of the
        layer, for a slice of a fused projection). ``inplace``: add into ``out`` (a view of a larger output);
        otherwise ``out`` is added into only when it is no view (the layer's own fresh output), else copied once."""
        segments = getattr(_local, "owners", None)
        rows = x.shape[0]
        if segments is None:
            if rows % self.n:
                raise RuntimeError(f"LoRA delta at {name}: {rows} batch rows for {self.n} requests")
            k = rows // self.n
            segments = tuple((j, k) for j in range(self.n))
        elif sum(c for _, c in segments) != rows:
            raise RuntimeError(f"LoRA delta at {name}: {rows} rows for a layout of {segments}")
        dtype = out.dtype
        owned = inplace or out._base is None
        rowsets: dict = {}  # the groups of this layer by the rows they cover (in plan order)
        for g, (adapter, weight, _) in enumerate(self.groups):
            m = adapter.modules.get(name)
            idx = self._index(g, segments, x.device) if m is not None else None
            if idx is not None:
                key = idx if isinstance(idx, str) else (idx.start, idx.stop) if isinstance(idx, slice) else id(idx)
                rowsets.setdefault(key, (idx, []))[1].append((g, m, weight))
        for idx, mods in rowsets.values():
            if not owned:  # one copy for the whole call, not one per group
                out, owned = out.clone(), True
            xa = x if x.dtype == mods[0][1].A.dtype else x.to(mods[0][1].A.dtype)
            rows_x = xa if isinstance(idx, str) else xa[idx]  # a slice is a view; an index tensor gathers
            # PEFT's own expression per adapter, B(A(x))·scaling, added in its order (in place: the same values as
            # out + d); several adapters on the same rows share one GEMM over their stacked A factors (x·[A1; A2]ᵀ)
            h = F.linear(rows_x, mods[0][1].A if len(mods) == 1 else self._stacked_a(name, mods))
            off = 0
            for _, m, weight in mods:
                r = m.A.shape[0]
                d = F.linear(h if len(mods) == 1 else h[..., off:off + r], m.B if part is None else m.B[part])
                d = d.mul_(m.scaling(weight))
                d = d if d.dtype == dtype else d.to(dtype)
                off += r
                if isinstance(idx, str):
                    out.add_(d)
                elif isinstance(idx, slice):
                    out[idx].add_(d)
                else:
                    out.index_add_(0, idx, d)
        return out

    def _stacked_a(self, name: str, mods) -> torch.Tensor:
        """``[A1; A2; …]`` of adapters on the same rows (made once per call and layer)."""
        key = (name, tuple(g for g, _, _ in mods))
        if key not in self._stacks:
            self._stacks[key] = torch.cat([m.A for _, m, _ in mods])
        return self._stacks[key]


def _name(layer) -> str | None:
    reg = getattr(layer, "_diffusers_hook", None)
    hook = reg.get_hook(HOOK_NAME) if reg is not None else None
    return hook.name if hook is not None else None


def current() -> BatchPlan | None:
    return getattr(_local, "plan", None)


def add(layer, x: torch.Tensor, out: torch.Tensor, part: slice | None = None) -> torch.Tensor:
    """``out`` (``layer``'s output on ``x``, or its features ``part``, computed without the layer's forward) plus
    the active plan's deltas of ``layer``, in place."""
    plan = current()
    name = _name(layer) if plan is not None else None
    return out if name is None else plan.apply(name, x, out, part, inplace=True)


def add_fused(layers: list, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out``: the outputs of ``layers`` on ``x`` side by side (one GEMM over their stacked weights); each layer's
    deltas added to its own columns, in place."""
    if current() is None:
        return out
    off = 0
    for layer in layers:
        n = layer.out_features
        add(layer, x, out[..., off:off + n])
        off += n
    return out


class owners:
    """``with owners(segments)``: dim 0 of every targeted layer's input inside is ``segments``, (request, rows) runs
    in order (nothing without an active plan). Requests are indices of the plan's (the denoiser call's) requests.
    Reusable: one layout entered around several calls."""

    def __init__(self, segments):
        self.segments = tuple((int(r), int(c)) for r, c in segments) if current() is not None else None
        self._prev = []

    def __enter__(self):
        if self.segments is not None:
            self._prev.append(getattr(_local, "owners", None))
            _local.owners = self.segments
        return self

    def __exit__(self, *exc):
        if self.segments is not None:
            _local.owners = self._prev.pop()


def batch_rows(rows, batch: int, counts=None) -> list[tuple[int, int]]:
    """Segments for batch rows ``rows`` of a ``batch``-row call: one run per row (``counts``: rows of the layer
    input each contributes, e.g. its computed tokens; default 1)."""
    plan = current()
    if plan is None:
        return []
    counts = counts if counts is not None else [1] * len(rows)
    return [(plan.request_of(i, batch), c) for i, c in zip(rows, counts)]


def row_of(i: int, batch: int) -> list[tuple[int, int]]:
    """The segment of row ``i`` of a ``batch``-row layer input called one row at a time: the current layout's
    (``owners``, one row per request) where one is set, else the call's own row ``i``."""
    segments = getattr(_local, "owners", None)
    if segments is not None and len(segments) == batch and all(c == 1 for _, c in segments):
        return [segments[i]]
    return batch_rows([i], batch)


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
def subset(rows: list[int], batch: int):
    """Inside: a denoiser part called on batch rows ``rows`` of a ``batch``-row call only (temporal reuse leaves the
    other rows out), with the adapters of those rows' requests, unmerged (a plan over just those requests)."""
    plan = current()
    if plan is None:
        yield
        return
    mine = sorted({plan.request_of(i, batch) for i in rows})
    sets = [tuple((a, w) for a, w, jobs in plan.groups if j in jobs) for j in mine]
    prev, prev_owners = _local.plan, getattr(_local, "owners", None)
    _local.plan, _local.owners = BatchPlan(sets), None
    try:
        yield
    finally:
        _local.plan, _local.owners = prev, prev_owners


@contextmanager
def active(plan: BatchPlan | None):
    """``plan`` applies to the denoiser calls this thread makes inside the block (and no layout from an outer
    call's ``owners``)."""
    prev, prev_owners = getattr(_local, "plan", None), getattr(_local, "owners", None)
    _local.plan, _local.owners = plan, None
    try:
        yield
    finally:
        _local.plan, _local.owners = prev, prev_owners
