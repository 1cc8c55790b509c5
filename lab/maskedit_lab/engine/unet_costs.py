"""What a plan can gain in an SD 2 / SDXL UNet: the FLOP-model ideal and the kernel ceiling of a step.

Only the UNet's transformer blocks scale with the masked tokens; the rest of the step (ResNets, down/up-sampling,
GroupNorm and the in/out projections of each ``Transformer2DModel``) runs in full in every mode. That rest is
measured, not modelled: one step with every transformer block bypassed, its FLOPs counted by torch's
``FlopCounterMode`` and its time taken on the device. The blocks are then added per plan:

- ideal: ``(rest + sum of full blocks) / (rest + sum of the plan's blocks)`` in FLOPs (``unet_block_flops``);
- kernel ceiling: the same with each block's GEMMs and attentions timed at their shapes (``kernel_ceiling``), i.e.
  the speedup if the engine added nothing to the stock kernels and the rest of the step. The rest enters as its
  share of a full step, timed in interleaved pairs (bypassed, full) so a host whose speed drifts (other work on
  its cores) shifts both alike: ``1 / (share + (1 - share) * plan_kernels / full_kernels)``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from maskedit_common.flops import unet_block_flops
from maskedit.cache.planner import FULL, KV, Y
from maskedit.device import seconds_between, time_mark

from .kernel_ceiling import KernelTimer


def timers(device, dtype) -> tuple:
    """Two ``timer_for(heads)`` functions, cache-hot and streamed weights (as ``KernelTimer.hot_and_streamed``)."""
    made: dict = {}

    def pick(i):
        def timer_for(heads: int) -> KernelTimer:
            if heads not in made:
                made[heads] = KernelTimer.hot_and_streamed(heads, device, dtype)
            return made[heads][i]
        return timer_for

    return pick(0), pick(1)


@contextlib.contextmanager
def blocks_bypassed(hooks):
    """Every transformer block returns its input (the rest of the UNet runs as usual)."""
    saved = [b.forward for b in hooks.blocks]
    for b in hooks.blocks:
        b.forward = lambda hidden_states, *a, **k: hidden_states
    try:
        yield
    finally:
        for b, f in zip(hooks.blocks, saved):
            b.forward = f


def _calls(mode: str, n: int, c: int, text: int, dim: int, text_dim: int) -> list[tuple]:
    """GEMMs ("mm", rows, in, out) and attentions ("attn", queries, keys) of one BasicTransformerBlock."""
    if mode == FULL:
        c = n
    u = n - c
    keys = n if mode in (FULL, Y, KV) else c
    calls = [("mm", c, dim, dim)] * 3  # q, k, v of the computed tokens
    if mode == Y and u:
        calls += [("mm", u, dim, dim)] * 2  # keys/values of the cached tokens from the block's input rows
    calls += [("attn", c, keys), ("mm", c, dim, dim)]  # self-attention, out
    calls += [("mm", c, dim, dim), ("mm", text, text_dim, dim), ("mm", text, text_dim, dim), ("attn", c, text),
              ("mm", c, dim, dim)]  # cross-attention
    calls += [("mm", c, dim, 8 * dim), ("mm", c, 4 * dim, dim)]  # GEGLU feed-forward
    return calls


@dataclass
class UNetStepCosts:
    hooks: object  # UNetCacheHooks
    grid: tuple[int, int]
    rows: int  # UNet rows per request (2 with classifier-free guidance)
    text: int
    text_dim: int
    rest_flops: float
    rest_s: float
    rest_time_share: float  # of a full step, median over interleaved pairs

    @classmethod
    @torch.no_grad()
    def measure(cls, runner, job_inputs, hooks, reps: int = 3) -> "UNetStepCosts":
        """Run one request's first step with the blocks bypassed: FLOPs and device time of the rest of the UNet."""
        from torch.utils.flop_counter import FlopCounterMode

        from maskedit.denoise import DenoiseJob
        from maskedit.families.unet_inpaint.prepare import cfg_rows
        from maskedit.families.unet_inpaint.step import prepare_job, step_group

        x = job_inputs
        r = cfg_rows(x.guidance)
        def one():
            job = DenoiseJob(x)
            prepare_job(runner, job)
            step_group(runner, [job])

        def timed() -> float:
            t0 = time_mark(runner.device)
            one()
            return seconds_between(t0, time_mark(runner.device), wait=True)

        with blocks_bypassed(hooks):
            one()  # warm-up
            with FlopCounterMode(display=False) as fc:
                one()
        one()
        rests, shares = [], []
        for _ in range(reps):  # interleaved pairs: drift in the host's speed hits both alike
            with blocks_bypassed(hooks):
                rest = timed()
            rests.append(rest)
            shares.append(rest / timed())
        text_rows = x.prompt_embeds.shape[0] // r
        return cls(hooks, (x.model_h // runner.pixels_per_token, x.model_w // runner.pixels_per_token), r,
                   text_rows, x.prompt_embeds.shape[1], float(fc.get_total_flops()), float(np.median(rests)),
                   float(np.median(shares)))

    def _blocks(self, modes: list[str], computed: np.ndarray | None) -> list[tuple[str, int, int, int]]:
        shapes = self.hooks.shapes(self.grid)
        counts = self.hooks.computed_counts(computed, self.grid) if computed is not None else \
            [shapes[b][0] for b in range(len(modes))]
        return [(m, shapes[b][0], counts[b], shapes[b][1]) for b, m in enumerate(modes)]

    def rest_share(self) -> dict:
        """How much of a full step the part that always runs in full takes, in FLOPs and in time."""
        blocks = self.rows * sum(unet_block_flops(FULL, n, n, self.text, d)
                                 for _, n, _, d in self._blocks([FULL] * len(self.hooks.blocks), None))
        return {"rest_flops_share": round(self.rest_flops / (self.rest_flops + blocks), 4),
                "rest_time_share": round(self.rest_time_share, 4)}

    def ideal_speedup(self, modes: list[str], computed: np.ndarray | None) -> float:
        flops = lambda ms: self.rest_flops + self.rows * sum(  # noqa: E731
            unet_block_flops(m, n, c, self.text, d) for m, n, c, d in self._blocks(ms, computed))
        return flops([FULL] * len(modes)) / flops(modes)

    def ceiling_speedup(self, modes: list[str], computed: np.ndarray | None, timer_for) -> float:
        """``timer_for(heads)``: the ``KernelTimer`` for blocks with that many heads (levels differ)."""
        def blocks_s(ms):
            total = 0.0
            for b, (m, n, c, d) in enumerate(self._blocks(ms, computed)):
                timer = timer_for(self.hooks.blocks[b].attn1.heads)
                for call in _calls(m, n, c, self.text, d, self.text_dim):
                    if call[0] == "mm":
                        total += timer.call_s(("mm", call[1] * self.rows, *call[2:]), d) if call[1] else 0.0
                    else:
                        total += self.rows * timer.call_s(call, d) if call[1] and call[2] else 0.0
            return total

        share = self.rest_time_share
        return 1.0 / (share + (1.0 - share) * blocks_s(modes) / blocks_s([FULL] * len(modes)))
