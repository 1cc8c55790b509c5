"""The merged (fused) path: a denoiser call whose requests all carry one adapter set (the same adapters with the
same scales, in the same order) runs each projection the set targets as ``F.linear(x, W + Σ scaling·B@A, bias)``
instead of adding the deltas per row. The base parameters are never written: merged weights are new tensors, kept
per adapter set while they fit a byte budget (the least recently used other set dropped first), else made for the
call and dropped.

Which path a projection takes is decided at its call under the set by a small cost model with throughputs measured
on the device once (``Costs.measure``): the unmerged deltas cost ``2·r·tokens·(in+out)`` FLOPs at the thin-GEMM
rate plus a fixed cost per adapter and layer; a merge ``in·out·(1 + 2·Σr)`` at the merge rate, once, amortised over
the calls the set is expected to run (the group's remaining steps) when the copy fits the budget, else every call.
A merged copy already held costs nothing more, so it is always used."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .delta import BatchPlan

log = logging.getLogger(__name__)

MODES = ("auto", "always", "never")
DEFAULT_BUDGET = 1 << 30  # merged copies held per denoiser (bytes); FLUX.1's attention + MLP is ~22 GB in bf16


def set_key(adapters) -> tuple:
    """One request's adapter set, as the merged cache knows it: (name, file digest, weight) in order."""
    return tuple((a.name, a.digest, float(w)) for a, w in adapters)


@dataclass(frozen=True)
class Costs:
    """Measured throughputs of the two paths on one device and dtype."""

    delta_flops: float  # FLOP/s of an unmerged delta: x·Aᵀ, ·Bᵀ·s and the add to the output
    merge_flops: float  # FLOP/s of a merge: W + (B@A)·s into a new tensor
    layer_s: float  # fixed seconds per adapter and projection of the unmerged path (calls, launches)

    def unmerged_s(self, tokens: int, fin: int, fout: int, ranks) -> float:
        return sum(2.0 * r * tokens * (fin + fout) / self.delta_flops + self.layer_s for r in ranks)

    def merge_s(self, fin: int, fout: int, ranks) -> float:
        return fin * fout * (1.0 + 2.0 * sum(ranks)) / self.merge_flops

    def prefer_merge(self, tokens: int, fin: int, fout: int, ranks, calls: int) -> bool:
        """Merging pays when its cost spread over ``calls`` is below the deltas' cost of one call."""
        return self.merge_s(fin, fout, ranks) / max(1, calls) < self.unmerged_s(tokens, fin, fout, ranks)

    @classmethod
    def measure(cls, fin: int, fout: int, tokens: int, rank: int, device, dtype, reps: int = 5) -> "Costs":
        """Time both paths at one projection's shape (seconds on the device; medians of ``reps``)."""
        g = torch.Generator("cpu").manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
        W, A, B = mk(fout, fin), mk(rank, fin), mk(fout, rank)
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

        def timed(fn) -> float:
            fn()
            ts = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        def delta(n):
            x, out = mk(n, fin), mk(n, fout)
            return timed(lambda: out + F.linear(F.linear(x, A), B) * 0.5)

        small = max(1, tokens // 64)
        t_big, t_small = delta(tokens), delta(small)
        flops = 2.0 * rank * (tokens - small) * (fin + fout)
        rate = flops / max(t_big - t_small, 1e-9)
        layer_s = max(0.0, t_small - 2.0 * rank * small * (fin + fout) / rate)
        t_merge = timed(lambda: merged_weight(W, [(_Factors(A, B), 1.0)]))
        return cls(rate, fin * fout * (1.0 + 2.0 * rank) / max(t_merge, 1e-9), layer_s)


def merged_weight(weight: torch.Tensor, mods) -> torch.Tensor:
    """``weight + Σ (B@A)·scaling`` as a new tensor (``weight`` is only read), adapter by adapter in PEFT's own
    expression (``get_delta_weight``, then the add ``merge`` does): in float32 it is bit-identical to the stock
    pipeline's ``fuse_lora``. Other dtypes sum in float32 and round once (``fuse_lora`` adds in the weight's dtype)."""
    acc = weight if weight.dtype == torch.float32 else weight.float()
    out = None
    for m, w in mods:
        d = (m.B.to(acc.dtype) @ m.A.to(acc.dtype)) * m.scaling(w)
        out = acc + d if out is None else out.add_(d)
    return out.to(weight.dtype)


class MergedPlan(BatchPlan):
    """A call whose requests all carry one set: projections the cost model merges run with the merged weight
    (``weight``); the others add their deltas as a ``BatchPlan`` does (every row, one weight: no gather)."""

    def __init__(self, per_request, merger: "Merger", calls_left: int):
        super().__init__(per_request)
        self.merger, self.calls_left = merger, calls_left
        self.adapters = per_request[0]
        self.key = set_key(self.adapters)

    def weight(self, name: str, module, x: torch.Tensor) -> torch.Tensor | None:
        return self.merger.weight(self, name, module, x)


class Merger:
    """The merged weights of one denoiser, per adapter set (LRU within ``budget_bytes``), and the path choice.
    ``mode``: ``auto`` (the cost model), ``always`` (merge every projection a same-set call touches), ``never``."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET, mode: str = "auto", costs: Costs | None = None):
        if mode not in MODES:
            raise ValueError(f"merge mode {mode!r}: one of {', '.join(MODES)}")
        self.budget, self.mode, self.costs = budget_bytes, mode, costs
        self._sets: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"merged_calls": 0, "unmerged_calls": 0, "merges": 0, "merge_s": 0.0}

    def plan(self, per_request, calls_left: int = 1) -> BatchPlan | None:
        """The plan of one denoiser call: None without adapters, merged when every request carries one set."""
        if not any(per_request):
            return None
        if self.mode != "never" and per_request[0] and len({set_key(s) for s in per_request}) == 1:
            return MergedPlan(per_request, self, calls_left)
        return BatchPlan(per_request)

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(_nbytes(d) for d in self._sets.values())

    def clear(self) -> None:
        with self._lock:
            self._sets.clear()

    def weight(self, plan: MergedPlan, name: str, module, x: torch.Tensor) -> torch.Tensor | None:
        mods = [(m, w) for a, w in plan.adapters if (m := a.modules.get(name)) is not None]
        if not mods:
            return None
        with self._lock:
            held = self._sets.get(plan.key, {}).get(name)
            if held is not None:
                self._sets.move_to_end(plan.key)
                self.stats["merged_calls"] += 1
                return held
        W = module.weight
        nbytes = W.numel() * W.element_size()
        fits = self._room(plan.key) >= nbytes
        if self.mode == "auto":
            ranks = [m.A.shape[0] for m, _ in mods]
            tokens = x.numel() // x.shape[-1]
            costs = self.costs or self._measure(W, tokens, ranks[0])
            if not costs.prefer_merge(tokens, W.shape[1], W.shape[0], ranks, plan.calls_left if fits else 1):
                self.stats["unmerged_calls"] += 1
                return None
        t0 = time.perf_counter()
        merged = merged_weight(W, mods)
        with self._lock:
            self.stats["merges"] += 1
            self.stats["merged_calls"] += 1
            self.stats["merge_s"] += time.perf_counter() - t0
            if fits:
                self._make_room(plan.key, nbytes)
                self._sets.setdefault(plan.key, {})[name] = merged
                self._sets.move_to_end(plan.key)
        return merged

    def _room(self, key) -> int:
        """Bytes the set ``key`` may still take (other sets can be dropped for it)."""
        with self._lock:
            return self.budget - _nbytes(self._sets.get(key, {}))

    def _make_room(self, key, nbytes: int) -> None:  # under the lock
        while sum(_nbytes(d) for d in self._sets.values()) + nbytes > self.budget:
            other = next((k for k in self._sets if k != key), None)
            if other is None:
                return
            del self._sets[other]

    def _measure(self, W: torch.Tensor, tokens: int, rank: int) -> Costs:
        with self._lock:
            if self.costs is not None:
                return self.costs
        costs = Costs.measure(W.shape[1], W.shape[0], tokens, rank, W.device, W.dtype)
        log.info("LoRA merge cost model on %s %s: unmerged deltas %.1f GFLOP/s + %.1f us per layer, merges "
                 "%.1f GFLOP/s", W.device, W.dtype, costs.delta_flops / 1e9, costs.layer_s * 1e6,
                 costs.merge_flops / 1e9)
        with self._lock:
            self.costs = self.costs or costs
            return self.costs


@dataclass
class _Factors:  # a ``LoraModule``'s shape for timing a merge
    A: torch.Tensor
    B: torch.Tensor

    def scaling(self, w: float) -> float:
        return 0.5 * w


def _nbytes(weights: dict) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


_merger_lock = threading.Lock()


def merger_for(denoiser, settings=None) -> Merger:
    """The denoiser's ``Merger`` (one per denoiser: the merged copies are of its weights), made with ``settings``'
    ``lora_merge`` mode and ``lora_merge_bytes`` budget (``MASKEDIT_LORA_MERGE[_BYTES]``) by its first caller."""
    m = denoiser.__dict__.get("_maskedit_lora_merger")
    if m is None:
        made = Merger() if settings is None else Merger(settings.lora_merge_bytes, settings.lora_merge)
        with _merger_lock:
            m = denoiser.__dict__.setdefault("_maskedit_lora_merger", made)
    return m
