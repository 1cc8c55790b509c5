"""The benchmarks' baselines, built by composition from the serving classes (which carry no baseline switches).

- ``FixedPolicy``: every recorded block of a hit in one mode, no planning (``all_y``, ``all_kv``, and ``noctx``:
  masked tokens computed without the unmasked context, the naive shortcut); what the planner is measured against;
- ``InlineRowLoader``: cached rows loaded inside the block that needs them, nothing queued ahead (the naive
  loading the paper's pipelined loader is measured against);
- ``PreloadedRowLoader``: a step's rows all on the device before it starts (calibration times the blocks alone);
- ``PerResolutionRunner``: one transformer call per resolution in a step (what packing saves);
- ``InlineWorkEngine``: pre/post-processing run on the denoise loop's thread between steps (what disaggregating
  them into other processes saves).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from maskedit.cache.modes import FULL, KV, NOCTX, Y
from maskedit.cache.loader import RowLoader
from maskedit.cache.policy import BlockPolicy, PlanInput
from maskedit.denoise import ModelRunner, group_by
from maskedit.device import synchronize
from maskedit.engine import DenoiseEngine

log = logging.getLogger(__name__)
FIXED_POLICIES = ("all_y", "all_kv", "noctx")


@dataclass(frozen=True)
class FixedPolicy(BlockPolicy):
    """``all_y``: Y wherever the entry recorded a block; ``all_kv``: KV where recorded, else Y where recorded;
    ``noctx``: masked tokens attend only to themselves and the text (so its hits compute no template context and
    never heal an entry)."""

    def __post_init__(self):
        if self.name not in FIXED_POLICIES:
            raise ValueError(f"fixed cache policy must be one of {FIXED_POLICIES}")

    @property
    def heals(self) -> bool:
        return self.name != "noctx"

    def plan(self, p: PlanInput) -> tuple[list[str], None]:
        if self.name == "all_y":
            return [Y if h else FULL for h in p.has_y], None
        if self.name == "noctx":
            return [NOCTX if h else FULL for h in p.has_y], None
        return [KV if k else (Y if y else FULL) for y, k in zip(p.has_y, p.has_kv)], None


def cache_policy(name: str) -> str | BlockPolicy:
    """What a ``CacheRuntime`` is given for policy ``name``: a serving policy's name as it is (``off``,
    ``planner``, ``planner_y``), or the fixed baseline of that name."""
    return FixedPolicy(name) if name in FIXED_POLICIES else name


class InlineRowLoader(RowLoader):
    def start_step(self, hits: list, needed):
        return None  # nothing queued: each block loads its own rows when it asks for them


class PreloadedRowLoader(RowLoader):
    """Every row a step reads is on the device before the step starts, so a block's timing holds its computation
    alone (calibration: loads are measured apart). With rows loaded inside the block, the host's verification of
    them (~4 ms a FLUX.1 block on the H200) was timed as compute: the Y/KV fits came out flat (R² ~ 0)."""

    def start_step(self, hits: list, needed):
        for fut, jc, step, b, kind in self.new_futures(hits, needed):
            try:
                fut.set_result(self.load(jc, step, b, kind))
            except Exception as e:  # as the loader thread: the block that reads it raises (a CorruptEntry)
                fut.set_exception(e)
        synchronize(self.device)
        return None


class PerResolutionRunner(ModelRunner):
    def groups(self, jobs):
        return group_by(jobs, lambda j: (tuple(j.tensors.prompt_embeds.shape), j.inputs.model_h, j.inputs.model_w))


class InlineWorkEngine(DenoiseEngine):
    """``call_soon(fn)`` runs ``fn()`` on the loop thread before the next step, blocking the batch as it would."""

    def __init__(self, *args, **kwargs):
        self._inline: list = []
        self.inline_s = 0.0
        super().__init__(*args, **kwargs)

    def call_soon(self, fn) -> None:
        with self._cv:
            self._inline.append(fn)
            self._cv.notify()

    def _idle(self) -> bool:
        return super()._idle() and not self._inline

    def _between_steps(self) -> bool:
        with self._cv:
            work, self._inline = self._inline, []
        t = time.perf_counter()
        for fn in work:
            try:
                fn()
            except Exception:
                log.exception("inline work failed")
        self.inline_s += time.perf_counter() - t
        return bool(work)
