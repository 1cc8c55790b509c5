"""The activation cache as one engine uses it: a facade over parts that each hold one idea.

- ``decision``: what the cache does for a request (off / record / hit / full), decided once before admission;
- ``policy``: which mode each block of a hit runs in (Algorithm 1 over the cost model, or a fixed baseline);
- ``live``: template runs in progress, which later requests on the same template follow;
- ``loader``: cached rows to the device, block by block, ahead of compute (a copy stream on a GPU);
- ``writer``: finished template runs and heals written into the store in the background;
- ``heal``: when a hit rewrites its entry with the template context it computed.

The request's side is a ``JobCache`` (on ``DenoiseJob.cache``): the decision carried out on the device.

A template run that was itself an edit records its own masked tokens as invalid (they hold its edit, not the
template), so every later hit recomputes them. A hit whose mask leaves some of them unmasked computes them as
template context: it records those rows (a ``patch``) and, once it completes, a healed copy of the entry replaces
the old one, so later hits compute only their own masked tokens. Entries are recorded and stored in the model's
dtype (a bf16 model's entries are half the bytes of float32 ones).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .controlnet import ControlNetCaches
from .cost_model import CostModel
from .decision import CacheDecision, decide
from .modes import FULL, KV, StepContext
from .heal import HEAL_MIN_RATIO, HealsInProgress, worth_healing
from .job_cache import JobCache, recorded_steps
from .live import LiveEntry, LiveRuns
from .loader import K_BUF, V_BUF, Y_ROWS, RowLoader
from .policy import POLICIES, BlockPolicy, PlanInput, make_policy
from .store import ActivationStore
from .writer import EntryWriter

log = logging.getLogger(__name__)

__all__ = ["POLICIES", "CacheRuntime", "JobCache"]


class CacheRuntime:
    def __init__(self, hooks, store: ActivationStore | None, cost: CostModel | None = None,
                 policy: str | BlockPolicy = "planner", budget_bytes: int = 1 << 30, record: bool = True,
                 heal_min_ratio: float = HEAL_MIN_RATIO, loader: type[RowLoader] = RowLoader,
                 lora_base_reuse: bool = False):
        """``policy``: a name in ``POLICIES`` or a ``BlockPolicy``; ``off`` caches nothing. ``loader``: how rows
        reach the device (benchmarks pass the naive baseline's, which loads inside the block).
        ``lora_base_reuse``: ``CacheSettings.lora_base_reuse`` (approximate; off by default)."""
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}")
        self.policy = policy if isinstance(policy, str) else policy.name
        self.block_policy = None if self.policy == "off" else (
            policy if isinstance(policy, BlockPolicy) else make_policy(policy, cost))
        self.hooks, self.store = hooks, store  # hooks: a family's (``cache.rows.TokenRowHooks`` describes them)
        self.budget_bytes, self.record = int(budget_bytes), record
        self.dim = hooks.dim
        self.kinds = hooks.kinds
        param = next(hooks.transformer.parameters())
        self.device, self.dtype = param.device, param.dtype  # rows are recorded, stored and loaded in these
        self.itemsize = param.element_size()
        self.loader = loader(self.device, *hooks.kv_heads())
        self.writer = EntryWriter(store) if store is not None else None
        self.live_runs = LiveRuns()
        self.heal_min_ratio = heal_min_ratio
        self.heals = HealsInProgress()
        self.lora_base_reuse = bool(lora_base_reuse)
        self._controls = None  # the ControlNets' runtimes (``cache.controlnet``), made on first use

    @property
    def controls(self):
        """Requests' Flux ControlNets cached beside this runtime's entries (``maskedit.cache.controlnet``)."""
        if self._controls is None:
            self._controls = ControlNetCaches(self)
        return self._controls

    # -- before admission -----------------------------------------------------------------------------
    def decide(self, x, count: bool = True) -> CacheDecision:
        """What the cache will do for ``x`` (``DenoiseInputs``). Bad cache state never fails a request: full."""
        if self.block_policy is None:
            return CacheDecision("off")
        try:
            return decide(x, self.store, self.live_runs, self.dim, len(self.kinds), self.record, count,
                          coarsest=getattr(self.hooks, "coarsest", 0), base_reuse=self.lora_base_reuse,
                          mask=self.hooks.cache_mask(x))
        except Exception:
            log.exception("activation cache unusable for %s; running in full", x.cache_key)
            return CacheDecision("off", x.cache_key)

    def recording(self, key: str | None) -> bool:
        """Is a template run of ``key`` in progress here (so a request on it would follow it)?"""
        return key is not None and key in self.live_runs

    # -- admission: carry the decision out on the device -----------------------------------------------
    def admit(self, job, decision: CacheDecision | None = None) -> JobCache:
        d = decision or self.decide(job.inputs)
        try:
            jc = self._admit(job, d)
        except Exception:
            log.exception("activation cache unusable for %s; running in full", d.key)
            jc = JobCache("off", key=d.key)
        if not jc.modes:
            jc.modes = [FULL] * len(self.kinds)
        job.cache = jc
        if getattr(job, "controls", ()):
            self.controls.admit(job)
        return jc

    def _admit(self, job, d: CacheDecision) -> JobCache:
        if d.status == "record" and not job.inputs.register:
            # The costly outcome is looked at again: while the request waited, its template may have been recorded
            # or a run of it started (a burst on a new template is decided all at once).
            d = self.decide(job.inputs, count=False)
        if d.status == "record":
            jc = self._start_recording(job, d.key)
            if jc.status != "off" or job.inputs.register:
                return jc
            d = self.decide(job.inputs, count=False)  # a run of this key started just now: follow it instead
            if d.status == "record":
                return JobCache("off", key=d.key)
        if d.status in ("off", "full"):
            return JobCache(d.status, key=d.key, entry=d.entry)
        x = job.inputs
        n, text = d.computed.size, x.prompt_embeds.shape[0]  # n: image tokens and any reference tokens
        dev = job.latents.device if job.latents is not None else "cpu"
        valid = np.asarray(d.entry.arrays["valid"], dtype=bool)
        jc = JobCache("hit", key=d.key, entry=d.entry, valid=valid, text_len=self.hooks.text_len(x),
                      live=d.entry.recorder if d.follows else None, computed=np.asarray(d.computed, bool),
                      base_reuse=d.base, first=int(d.entry.meta.get("first_step", 0)))
        idx_c = np.flatnonzero(d.computed)
        jc.idx_c = torch.from_numpy(idx_c).to(dev)
        jc.idx_u = torch.from_numpy(np.flatnonzero(~d.computed)).to(dev)
        m = d.entry.meta
        jc.modes, jc.predicted_ms = self.block_policy.plan(PlanInput(
            self.kinds, n, int(d.computed.sum()), text, self.dim, self.itemsize,
            [b in m["y_blocks"] for b in range(len(self.kinds))], [b in m["kv_blocks"] for b in range(len(self.kinds))],
            self.hooks.plan_blocks(x, d.computed, m)))
        jc.needs_output = self.hooks.needs_output(jc.modes)
        if d.heal is not None and jc.first == getattr(x, "first_step", 0):  # a heal rewrites every step's rows
            self._maybe_heal(jc, recorded_steps(x), d.heal, idx_c)
        return jc

    def _maybe_heal(self, jc: JobCache, x, heal: np.ndarray, idx_c: np.ndarray) -> None:
        """Record the rows of ``heal`` (invalid tokens this hit computes as template context, among ``idx_c``) if
        worth a rewrite."""
        if not self.record or not self.block_policy.heals or not worth_healing(heal, self.heal_min_ratio):
            return
        if not self.heals.claim(jc.key):
            return
        jc.heal = np.flatnonzero(heal)
        self.hooks.heal_recorder(jc, x, heal, idx_c, jc.entry.meta, self.dtype, self.device)

    def _start_recording(self, job, key: str) -> JobCache:
        if not self.record:
            return JobCache("off", key=key)
        x = recorded_steps(job.inputs)
        per_y = self.hooks.block_bytes(x, self.itemsize)
        budget = self._budget(job)
        y_blocks, kv_blocks = [], []
        for b in range(len(self.kinds)):
            if budget >= per_y[b]:
                y_blocks.append(b)
                budget -= per_y[b]
        for b in range(len(self.kinds)):
            if budget >= 2 * per_y[b]:
                kv_blocks.append(b)
                budget -= 2 * per_y[b]
        rec, layout = self.hooks.recorder(x, y_blocks, kv_blocks, self.dtype, self.device)
        valid = ~self.hooks.cache_mask(x)  # tokens this request edits are not template context
        first = getattr(job.inputs, "first_step", 0)
        meta = {"tokens": int(valid.size), "steps": job.inputs.steps, "dim": self.dim, "blocks": len(self.kinds),
                "n_dual": self.hooks.n_dual, "y_blocks": y_blocks, "kv_blocks": kv_blocks,
                "valid_tokens": int(valid.sum()), "reference_tokens": self.hooks.reference_tokens(x), **layout}
        if first:
            meta["first_step"] = first
        # The run's entry while it records: followers read it; once complete it is what the store saves.
        live = LiveEntry(meta, {**rec.tensors(), "valid": valid}, rec)
        if not self.live_runs.start(key, live):  # a run of this key (or a re-registration) is in progress
            return JobCache("off", key=key)
        return JobCache("record", key=key, entry=live, recorder=rec, valid=valid, first=first)

    def _budget(self, job) -> int:
        """The bytes this template run may record: the configured budget, or its share of it where the request's
        ControlNets record beside it (``cache.controlnet.split_budget``; a control's rows carry their share)."""
        share = getattr(job, "cache_budget", None)  # a control's rows (``cache.controlnet._ControlRows``)
        if share is not None:
            return share
        if getattr(job, "controls", ()):  # the whole budget where none of them is cached (their weights are 0)
            return self.controls.budgets(job)[0]
        return self.budget_bytes

    # -- per step -----------------------------------------------------------------------------------
    def context(self, jobs, loads=None) -> StepContext:
        """The step's views of ``jobs``; ``loads(jc, b, kinds)``: the kinds of a hit's cached rows of block ``b`` to
        queue (temporal reuse skips blocks whose rows would go unread), default all it needs."""
        views, hits = [], []
        for job in jobs:
            jc: JobCache = job.cache
            row = job.step_index - jc.first  # the entry's rows start at its first step
            if jc.status == "record":
                views.append(self.hooks.view(job, jc, recorder=jc.recorder))
            elif jc.status == "hit" and jc.ready(row):
                views.append(self.hooks.view(job, jc, rows=self.loader.rows(jc, row)))
                hits.append((jc, row))
            else:
                if jc.status == "hit":  # a follower ahead of the run it follows: this step in full
                    jc.full_steps += 1
                views.append(None)
        needed = self._needed if loads is None else (lambda jc, b: loads(jc, b, self._needed(jc, b)))
        return StepContext(views, on_block=self.loader.start_step(hits, needed), controls=self._controls)

    @staticmethod
    def _needed(jc: JobCache, b: int) -> list[str]:
        kinds = [K_BUF, V_BUF] if jc.modes[b] == KV else []
        if jc.needs_output[b]:
            kinds.append(Y_ROWS)
        return kinds

    def after_step(self, jobs) -> None:
        if self._controls is not None:
            self._controls.after_step(jobs)
        for job in jobs:
            jc = job.cache
            if jc is not None and jc.recorder is not None:
                jc.recorder.next_step()
            if jc is not None and jc.patch is not None:
                jc.patch.next_step()

    def finish(self, job, ok: bool) -> None:
        """A job left the batch: save its recording and its heal (in the background) if it completed."""
        jc: JobCache | None = job.cache
        if jc is None:
            return
        if self._controls is not None:
            self._controls.finish(job, ok)
        self.loader.cancel(jc)
        if jc.status == "record":
            if ok and self.writer is not None:
                self.writer.save(jc.key, jc.entry, jc.valid, self.dtype,
                                 then=lambda: self.live_runs.end(jc.key))  # saved (or not): later requests open it
            else:
                self.live_runs.end(jc.key)
        if jc.patch is not None:
            # Incomplete when a block ran in full for this request (the planner's choice) or it failed: no heal.
            if ok and jc.patch.complete and self.writer is not None:
                self.writer.heal(jc.key, jc.entry, jc.heal, jc.patch, then=lambda: self.heals.release(jc.key))
            else:
                self.heals.release(jc.key)

    def corrupt(self, job, error: BaseException) -> None:
        """``job``'s entry failed verification: discard that file and end the job's use of the cache."""
        entry = getattr(error, "entry", None) or (job.cache.entry if job.cache is not None else None)
        if self.store is not None and getattr(entry, "ident", None) is not None:
            self.store.invalidate(entry, str(error))
        self.finish(job, ok=False)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for pending writes (tests, shutdown)."""
        if self.writer is not None:
            self.writer.flush(timeout)
        if self._controls is not None:
            self._controls.flush(timeout)

    def close(self) -> None:
        if self._controls is not None:
            self._controls.close()
        if self.writer is not None:
            self.writer.close()
        self.loader.close()
