"""The benchmarks' baselines, built by composition from the serving classes (which carry no baseline switches).

- ``InlineRowLoader``: cached rows loaded inside the block that needs them, nothing queued ahead (the naive
  loading the paper's pipelined loader is measured against);
- ``PerResolutionRunner``: one transformer call per resolution in a step (what packing saves);
- ``InlineWorkEngine``: pre/post-processing run on the denoise loop's thread between steps (what disaggregating
  them into other processes saves).
"""

from __future__ import annotations

import logging
import time

from maskedit.cache.loader import RowLoader
from maskedit.denoise import ModelRunner, group_by
from maskedit.engine import DenoiseEngine

log = logging.getLogger(__name__)


class InlineRowLoader(RowLoader):
    def start_step(self, hits: list, needed):
        return None  # nothing queued: each block loads its own rows when it asks for them


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
