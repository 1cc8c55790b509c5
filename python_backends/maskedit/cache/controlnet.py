"""Mask-aware, cached Flux ControlNets: a ``FluxControlNetModel`` is built from the base transformer's block classes,
so its unmasked rows are recorded in the template run and reused on hits exactly as the base's are.

Each control of a request gets its own entry, keyed apart from the base's (``control_key``: the base key, which
holds the request's controls, plus the control's index), recorded and read by a ``CacheRuntime`` over that
ControlNet's blocks (``FluxControlNetCacheHooks``) that shares the base runtime's store, policy and budget. So the
store's integrity checks, live runs (followers), heals and eviction are those of any entry. The request's cache
status drives it: only a template run (``record``) or a hit (``hit``) of the base admits its controls.

On a hit the ControlNet computes its masked rows only; its unmasked rows are the template's, written into every
block's output that is not computed in full (``needs_output``), so its ``controlnet_blocks`` give the template's
residuals on unmasked tokens and fresh ones on masked tokens. The base transformer's forward adds them per token
after each block (``interval_control``), which its masked path leaves in place: exact on both sets of rows under
the cache's assumption (unmasked tokens follow the template).

A control acting only in part of the schedule (start > 0, end < 1) is not computed outside its window: its key
holds the window (``cache.key.control_identity``), so a hit skips the same steps as the template run, whose
recorder marks those steps' slots as zeros (``Recorder.skip_step``) so its entry completes. A control at scale 0 is
never computed: nothing to cache.

Budget: the request's entries share the configured recording budget (``CacheSettings``: bytes of rows one template
run may record), split between the transformer and its controls' ControlNets in proportion to their rows' bytes
(``split_budget``), so a request with two controls records no more than one without.
"""

from __future__ import annotations

import copy
import hashlib

from .flux import FluxControlNetCacheHooks
from .modes import FULL


def split_budget(total: int, weights: list[int]) -> list[int]:
    """``total`` bytes split in proportion to ``weights`` (each part's rows' bytes if it recorded them all), rounded
    down: the parts never add up to more than ``total``."""
    whole = sum(weights)
    if whole <= 0:
        return [0 for _ in weights]
    return [int(total * w // whole) for w in weights]


def control_key(base_key: str, index: int) -> str:
    """The entry of control ``index`` of a request whose (base) key, which covers all its controls, is ``base_key``."""
    return hashlib.sha256(f"{base_key}:controlnet:{index}".encode()).hexdigest()[:40]


class _ControlRows:
    """One control of a job as the ControlNet's runtime sees it: the job's step and latents, its own inputs (the
    control's key) and cache state."""

    def __init__(self, job, inputs, cache=None, control=None, budget: int | None = None):
        self.job, self.inputs, self.cache, self.control = job, inputs, cache, control
        self.cache_budget = budget  # its share of the request's recording budget (``split_budget``)

    @property
    def latents(self):
        return self.job.latents

    @property
    def step_index(self):
        return self.job.step_index


class ControlNetCaches:
    """The ControlNets' runtimes next to a base ``CacheRuntime`` (one per loaded ControlNet), and each admitted
    job's controls."""

    def __init__(self, base):
        self.base = base
        self._runtimes: dict = {}  # id(model) -> (model, CacheRuntime)
        self._jobs: dict = {}  # id(job) -> (job, (_ControlRows per control))

    def runtime(self, net):
        from .runtime import CacheRuntime

        got = self._runtimes.get(id(net))
        if got is None or got[0] is not net:
            b = self.base
            rt = CacheRuntime(FluxControlNetCacheHooks.of(net), b.store, policy=b.block_policy,
                              budget_bytes=b.budget_bytes, record=b.record, heal_min_ratio=b.heal_min_ratio)
            got = self._runtimes[id(net)] = (net, rt)
        return got[1]

    # -- the request's lifetime (called by the base runtime) ------------------------------------------------
    def admit(self, job) -> None:
        from .runtime import JobCache

        jc = job.cache
        controls = getattr(job, "controls", ())
        if not controls or jc is None or jc.status not in ("record", "hit") or not jc.key:
            return
        rows = []
        budgets = self.budgets(job)
        for k, active in enumerate(controls):
            if not self.cacheable(active):
                rows.append(_ControlRows(job, job.inputs, JobCache("off")))
                continue
            x = copy.copy(job.inputs)
            x.cache_key = control_key(jc.key, k)
            p = _ControlRows(job, x, control=active, budget=budgets[k + 1])
            c = self.runtime(active.model).admit(p)
            if c.status == "hit":  # every cached-mode block writes its template rows: the residuals read them
                c.needs_output = [m != FULL for m in c.modes]
            rows.append(p)
        self._jobs[id(job)] = (job, tuple(rows))

    @staticmethod
    def cacheable(active) -> bool:
        """A control whose ControlNet runs here (loaded, a transformer) and is computed at some step."""
        return active.spec.scale != 0 and active.model is not None and hasattr(active.model, "transformer_blocks")

    def budgets(self, job) -> list[int]:
        """The request's recording budget split between the transformer (first) and each control (0 for one not
        cached)."""
        x = job.inputs
        weights = [sum(self.base.hooks.block_bytes(x, self.base.itemsize))]
        for active in job.controls:
            if self.cacheable(active):
                rt = self.runtime(active.model)
                weights.append(sum(rt.hooks.block_bytes(x, rt.itemsize)))
            else:
                weights.append(0)
        return split_budget(self.base.budget_bytes, weights)

    def rows(self, job) -> tuple:
        got = self._jobs.get(id(job))
        return got[1] if got is not None and got[0] is job else ()

    def after_step(self, jobs) -> None:
        for job in jobs:
            for p in self.rows(job):
                if p.cache.status == "off":
                    continue
                rec = p.cache.recorder
                if rec is not None and p.control.scale_at(rec.step, job.steps) == 0:  # outside its window
                    rec.skip_step()
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
        from .runtime import JobCache

        off = JobCache("off")
        rows = []
        for u in uses:
            mine = self.rows(group[u.row])
            rows.append(mine[u.order] if u.order < len(mine) else _ControlRows(group[u.row], None, off))
        if all(p.cache.status == "off" for p in rows):
            return fn()
        rt = self.runtime(net)
        return rt.hooks.run(rt.context(rows), fn)

    def flush(self, timeout: float = 60.0) -> None:
        for _, rt in self._runtimes.values():
            rt.flush(timeout)

    def close(self) -> None:
        for _, rt in self._runtimes.values():
            rt.close()
