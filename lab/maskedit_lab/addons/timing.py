"""How ``bench_addons`` measures a case: FLOPs by torch's counter, wall and CPU seconds of a step batch."""

from __future__ import annotations

import time

import torch

from maskedit.denoise import DenoiseJob


def count_flops(fn) -> int:
    """FLOPs of ``fn()`` by torch's FlopCounterMode (matmuls and attention; on the CPU its flash-attention kernel is
    counted with the same formula as the GPU's)."""
    from torch.utils import flop_counter as fc

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None and op not in fc.flop_registry:
        fc.register_flop_formula(op)(lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v))
    with fc.FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def clock() -> tuple[float, float]:
    """(wall, this process's CPU) seconds: on a shared host the CPU time is what other processes disturb least."""
    return time.perf_counter(), time.process_time()


def since(t0) -> tuple[float, float]:
    t = clock()
    return t[0] - t0[0], t[1] - t0[1]


def drive(runner, inputs) -> tuple[float, float]:
    """(wall, CPU) seconds to denoise ``inputs`` together, one step batch (adapters resolved, and loaded if cold,
    in ``prepare`` as at admission)."""
    t0 = clock()
    jobs = [DenoiseJob(x) for x in inputs]
    for j in jobs:
        runner.prepare(j)
    while not all(j.done for j in jobs):
        runner.step([j for j in jobs if not j.done])
    sync(runner.device)
    return since(t0)
