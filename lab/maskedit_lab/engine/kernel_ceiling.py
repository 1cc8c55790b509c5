"""What the stock kernels allow: a plan's speedup if every GEMM and attention call ran at the speed these
kernels reach *at that call's shape* on this machine, and all else (norms, rotary, gathers) were free.

The FLOP model (``flops.py``) assumes one throughput for all shapes. On CPU a GEMM over the ~100-300
rows of a masked block runs 10-40% slower per FLOP than over the ~1000 rows of a full one, and so does
attention with few queries, so part of the gap between measured and FLOP-ideal speedup is the kernels',
not the engine's. This module times each distinct call shape once (same ops, same threads, random data)
and sums them per plan, so the benchmark can report both ceilings side by side.

Two variants: *hot* weights (one matrix per shape, in cache: the kernels' best case) and *streamed* weights
(each call reads a different matrix from a pool several times the last-level cache). A real step reads every
weight once, so on a CPU whose cache is smaller than the model it streams them from memory; that costs a GEMM
over few rows relatively more than one over many, which lowers the speedup a masked step can reach.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

from maskedit.device import is_cuda, seconds_between, time_mark
from maskedit_common.blocks import FULL, KV, Y


def _calls(mode: str, dual: bool, n: int, c: int, text: int, dim: int) -> list[tuple]:
    """The GEMMs ("mm", rows, in, out) and attentions ("attn", queries, keys) of one block."""
    if mode == FULL:
        c = n
    u = n - c
    keys = text + (c if mode not in (FULL, Y, KV) else n)  # noctx: text and computed rows only
    calls: list[tuple] = []
    if dual:
        calls += [("mm", c, dim, dim)] * 4 + [("mm", c, dim, 4 * dim), ("mm", c, 4 * dim, dim)]
        calls += [("mm", text, dim, dim)] * 4 + [("mm", text, dim, 4 * dim), ("mm", text, 4 * dim, dim)]
    else:
        r = text + c
        calls += [("mm", r, dim, dim)] * 3 + [("mm", r, dim, 4 * dim), ("mm", r, 5 * dim, dim)]
    if mode == Y and u:
        calls += [("mm", u, dim, dim)] * 2  # keys/values of cached tokens from their cached inputs
    calls.append(("attn", text + c, keys))
    return calls


def last_level_cache_bytes() -> int:
    try:
        return int(os.sysconf("SC_LEVEL3_CACHE_SIZE")) or 32 << 20
    except (ValueError, OSError, AttributeError):  # not Linux/glibc
        return 32 << 20


class KernelTimer:
    """Times call shapes once each (memoized) with the model's head layout."""

    def __init__(self, heads: int, reps: int = 20, stream_bytes: int = 0, device="cpu",
                 dtype: torch.dtype = torch.float32):
        """``stream_bytes`` > 0: GEMM weights come from a pool of distinct matrices this large (streamed weights);
        0: one cache-hot matrix per shape. Shapes are timed on ``device`` in ``dtype`` (the model's)."""
        self.heads, self.reps, self.stream_bytes = heads, reps, stream_bytes
        self.device, self.dtype = torch.device(device), dtype
        self._memo: dict[tuple, float] = {}

    @classmethod
    def hot_and_streamed(cls, heads: int, device="cpu", dtype: torch.dtype = torch.float32
                         ) -> tuple["KernelTimer", "KernelTimer"]:
        """The two variants the benchmarks report: cache-hot weights, and weights streamed from a pool four times
        the last-level cache (the GPU's L2 on a GPU)."""
        llc = torch.cuda.get_device_properties(device).L2_cache_size if is_cuda(device) else last_level_cache_bytes()
        return cls(heads, device=device, dtype=dtype), cls(heads, stream_bytes=4 * llc, device=device, dtype=dtype)

    def _time(self, fn) -> float:
        """Seconds per call: wall time on the CPU, CUDA events on a GPU (the host only queues kernels there)."""
        for _ in range(3):
            fn()
        t0 = time_mark(self.device)
        for _ in range(self.reps):
            fn()
        return seconds_between(t0, time_mark(self.device), wait=True) / self.reps

    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def call_s(self, call: tuple, dim: int) -> float:
        key = (*call, dim)
        if key not in self._memo:
            if call[0] == "mm":
                _, rows, d_in, d_out = call
                x, b = self._randn(rows, d_in), self._randn(d_out)
                item = torch.finfo(self.dtype).bits // 8
                pool = max(1, self.stream_bytes // (item * d_in * d_out))  # oldest first: long out of cache
                weights = itertools.cycle([self._randn(d_out, d_in) for _ in range(pool)])
                self._memo[key] = self._time(lambda: F.linear(x, next(weights), b)) if rows else 0.0
            else:
                _, q_rows, k_rows = call
                hd = dim // self.heads
                q = self._randn(1, self.heads, q_rows, hd)
                k, v = self._randn(1, self.heads, k_rows, hd), self._randn(1, self.heads, k_rows, hd)
                self._memo[key] = self._time(lambda: F.scaled_dot_product_attention(q, k, v))
        return self._memo[key]

    def step_s(self, modes: list[str], n_dual: int, n: int, c: int, text: int, dim: int,
               in_channels: int = 64, out_channels: int = 64, batch: int = 1) -> float:
        """One step for ``batch`` such requests in one call: GEMMs over all their rows at once (token-wise work
        is concatenated), attention once per request."""
        edges = [("mm", n, in_channels, dim), ("mm", n, dim, out_channels)]  # x_embedder, proj_out: every token
        calls = edges + [call for i, m in enumerate(modes) for call in _calls(m, i < n_dual, n, c, text, dim)]
        return sum(self.call_s(("mm", call[1] * batch, *call[2:]), dim) if call[0] == "mm"
                   else batch * self.call_s(call, dim) for call in calls)

    def batching_ceiling(self, modes: list[str], n_dual: int, n: int, c: int, text: int, dim: int,
                         batch: int, **edges) -> float:
        """Throughput of ``batch`` requests sharing each step over one request alone, if only these kernels
        cost time: what batching can gain here (bigger GEMMs; with streamed weights, each weight read once per
        step for the whole batch)."""
        return batch * self.step_s(modes, n_dual, n, c, text, dim, **edges) / \
            self.step_s(modes, n_dual, n, c, text, dim, batch=batch, **edges)

    def ceiling_speedup(self, modes: list[str], n_dual: int, n: int, c: int, text: int, dim: int,
                        **edges) -> float:
        full = self.step_s([FULL] * len(modes), n_dual, n, n, text, dim, **edges)
        return full / self.step_s(modes, n_dual, n, c, text, dim, **edges)
