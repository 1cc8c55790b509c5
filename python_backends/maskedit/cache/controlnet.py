"""Mask-aware, cached ControlNets: a ControlNet is built from the base denoiser's block classes (a
``FluxControlNetModel`` from Flux's transformer blocks; a UNet ``ControlNetModel`` is the UNet's down path and mid
block), so its unmasked rows are recorded in the template run and reused on hits exactly as the base's are. The base
runtime's hooks say which hooks a ControlNet gets (``controlnet_hooks``: ``cache.flux`` for Flux, the UNet's own
``UNetCacheHooks`` for SD 2 / SDXL).

Each control of a request gets its own entry, keyed apart from the base's (``control_key``: the base key, which
holds the request's controls, plus the control's index), recorded and read by a ``CacheRuntime`` over that
ControlNet's blocks (the base hooks' ``controlnet_hooks``) that shares the base runtime's store, policy and budget.
So the store's integrity checks, live runs (followers), heals and eviction are those of any entry. The request's
cache status drives it: only a template run (``record``) or a hit (``hit``) of the base admits its controls.

On a hit the ControlNet computes its masked rows only; its unmasked rows are the template's. Flux: written into
every block's output that is not computed in full (``needs_output``), so its ``controlnet_blocks`` give the
template's residuals on unmasked tokens and fresh ones on masked tokens; the base transformer's forward adds them per
token after each block (``interval_control``), which its masked path leaves in place: exact on both sets of rows
under the cache's assumption (unmasked tokens follow the template). UNet: only the transformer blocks are masked
(the ResNets, zero convolutions and down-samplers run on every token, as in the UNet), so the residuals cover every
token and the UNet adds them where its forward does.

A control acting only in part of the schedule (start > 0 or end < 1) is computed at its active steps only (the
pipelines' ``controlnet_keep`` is 0 elsewhere and the step skips it). Its key holds the window
(``cache.key.control_identity``) and its entry holds those steps only: the control's view counts steps from its first
active one and moves on only after a step that ran it. A control at scale 0 never runs: nothing to cache.

Budget: the request's entries share the configured recording budget (``CacheSettings``: bytes of rows one template
run may record), split between the base denoiser and its controls' ControlNets in proportion to their rows' bytes
(``split_budget``), so a request with two controls records no more than one without.
"""

from __future__ import annotations

import copy
import hashlib

from ..controlnets.job import run_position
from .job_cache import JobCache, recorded_steps
from .modes import FULL


def split_budget(total: int, weights: list[int]) -> list[int]:
    """``total`` bytes split in proportion to ``weights`` (each part's rows' bytes if it recorded them all), rounded
    down: the parts never add up to more than ``total``."""
    whole = sum(weights)
    if whole <= 0:
        return [0 for _ in weights]
    return [int(total * w // whole) for w in weights]


def control_key(base_key: str, index: int, first: int = 0) -> str:
    """The entry of control ``index`` of a request whose (base) key, which covers all its controls, is ``base_key``;
    ``first``: the schedule step it first acts at (its window is counted in the steps a STRENGTH < 1 edit runs, so
    its active steps move with the strength; 0 keeps the key of a full-schedule window starting at 0)."""
    tail = f":{first}" if first else ""
    return hashlib.sha256(f"{base_key}:controlnet:{index}{tail}".encode()).hexdigest()[:40]


class _ControlRows:
    """One control of a job as the ControlNet's runtime sees it: the job's step and latents, its own inputs (the
    control's key) and cache state."""

    def __init__(self, job, inputs, cache=None, first: int = 0, budget: int | None = None):
        self.job, self.inputs, self.cache, self.first = job, inputs, cache, first
        self.cache_budget = budget  # its share of the request's recording budget (``split_budget``)

    @property
    def latents(self):
        return self.job.latents

    @property
    def step_index(self):
        return self.job.step_index - self.first  # a windowed control's entry starts at its first active step


class ControlNetCaches:
    """The ControlNets' runtimes next to a base ``CacheRuntime`` (one per loaded ControlNet), and each admitted
    job's controls."""

    def __init__(self, base):
        self.base = base
        self._runtimes: dict = {}  # id(model) -> (model, CacheRuntime)
        self._jobs: dict = {}  # id(job) -> (job, (_ControlRows per control))

    def runtime(self, net):
        got = self._runtimes.get(id(net))
        if got is None or got[0] is not net:
            b = self.base  # a runtime of the base's own kind, over the ControlNet's blocks
            rt = type(b)(b.hooks.controlnet_hooks(net), b.store, policy=b.block_policy,
                              budget_bytes=b.budget_bytes, record=b.record, heal_min_ratio=b.heal_min_ratio)
            got = self._runtimes[id(net)] = (net, rt)
        return got[1]

    # -- the request's lifetime (called by the base runtime) ------------------------------------------------
    def admit(self, job) -> None:
        jc = job.cache
        controls = getattr(job, "controls", ())
        if not controls or jc is None or jc.status not in ("record", "hit") or not jc.key:
            return
        rows = []
        plans = self.plans(job)
        budgets = self.budgets(job, plans)
        for k, (active, steps) in enumerate(zip(controls, plans)):
            if steps is None:
                rows.append(_ControlRows(job, job.inputs, JobCache("off")))
                continue
            moved = steps[0] if getattr(job.inputs, "first_step", 0) else 0  # STRENGTH < 1: its window moved
            x = self._inputs(job, steps, control_key(jc.key, k, moved))
            p = _ControlRows(job, x, first=steps[0], budget=budgets[k + 1])
            c = self.runtime(active.model).admit(p)
            if c.status == "hit" and self.base.hooks.controlnet_reads_every_block:
                c.needs_output = [m != FULL for m in c.modes]  # the residuals read every block's template rows
            rows.append(p)
        self._jobs[id(job)] = (job, tuple(rows))
        job.control_cache = tuple(p.cache for p in rows)  # EDIT_INFO ``control_cache``

    def plans(self, job) -> list:
        """Per control of ``job``: the steps it acts on if it is cached (its ControlNet runs here, in a form the
        base hooks cache, at some step), else None."""
        out = []
        first = getattr(job.inputs, "first_step", 0)
        for active in getattr(job, "controls", ()):  # schedule steps; the window counts the steps the edit runs
            steps = [i for i in range(first, job.steps) if active.scale_at(*run_position(job, i)) != 0]
            ok = steps and active.model is not None and self.base.hooks.caches_controlnet(active.model)
            out.append(steps if ok else None)
        return out

    @staticmethod
    def _inputs(job, steps: list[int], key: str | None):
        x = copy.copy(job.inputs)
        x.cache_key, x.steps = key, len(steps)  # its entry: its active steps only
        if hasattr(x, "first_step"):
            x.first_step = 0  # counted from its first active step (``_ControlRows.step_index``)
        if hasattr(x, "base_cache_key"):
            x.base_cache_key = None  # never the base's rows (``lora_base_reuse``): another model's
        return x

    def budgets(self, job, plans: list | None = None) -> list[int]:
        """The request's recording budget split between the base denoiser (first) and each control (0 for one not
        cached), by the bytes each would record."""
        plans = self.plans(job) if plans is None else plans
        weights = [sum(self.base.hooks.block_bytes(recorded_steps(job.inputs), self.base.itemsize))]
        for active, steps in zip(job.controls, plans):
            if steps is None:
                weights.append(0)
                continue
            rt = self.runtime(active.model)
            weights.append(sum(rt.hooks.block_bytes(self._inputs(job, steps, None), rt.itemsize)))
        return split_budget(self.base.budget_bytes, weights)

    def rows(self, job) -> tuple:
        got = self._jobs.get(id(job))
        return got[1] if got is not None and got[0] is job else ()

    def after_step(self, jobs) -> None:
        """After a step (``job.step_index`` already moved on): a control's view moves on where the step ran it."""
        for job in jobs:
            for k, p in enumerate(self.rows(job)):
                if p.cache.status != "off" and \
                        job.controls[k].scale_at(*run_position(job, job.step_index - 1)) != 0:
                    self._owner(p).after_step([p])

    def finish(self, job, ok: bool) -> None:
        for p in self.rows(job):
            if p.cache.status != "off":
                self._owner(p).finish(p, ok)
        self._jobs.pop(id(job), None)

    def _owner(self, p: _ControlRows):
        k = next(i for i, q in enumerate(self.rows(p.job)) if q is p)
        return self.runtime(p.job.controls[k].model)

    # -- a ControlNet call ----------------------------------------------------------------------------------
    def run(self, net, group: list, uses: list, fn):
        """``fn()`` (one ControlNet call over ``uses``: rows of ``group``'s jobs, each a ``controlnets.flux.Use``) with
        each row's cache view active: recording, a hit's masked rows, or plain."""
        off = JobCache("off")
        rows = []
        for u in uses:
            mine = self.rows(group[u.row])
            rows.append(mine[u.order] if u.order < len(mine) else _ControlRows(group[u.row], None, off))
        if all(p.cache.status == "off" for p in rows):
            return fn()
        rt = self.runtime(net)
        return rt.hooks.run(rt.context(rows), fn)

    def view(self, job, k: int):
        """(hooks, step context) for job's control ``k`` alone at this step (a family whose ControlNet call holds one
        request, e.g. the UNet's: ``control_residuals``), or None when that control is not cached."""
        mine = self.rows(job)
        if k >= len(mine) or mine[k].cache.status == "off":
            return None
        rt = self._owner(mine[k])
        return rt.hooks, rt.context([mine[k]])

    def flush(self, timeout: float = 60.0) -> None:
        for _, rt in self._runtimes.values():
            rt.flush(timeout)

    def close(self) -> None:
        for _, rt in self._runtimes.values():
            rt.close()
