"""Per-engine glue of the activation cache: admit a request (hit / record / off), plan its blocks, stream
its cached rows in while earlier blocks compute, and write template runs into the store.

A request on a template whose template run is still in progress in this engine *follows* it: it reads the rows
the run has recorded so far from memory (``_Live``) instead of recomputing the whole model or waiting for the
store. Joining at a later step boundary, it is always at least one step behind, so its rows exist; a step the
run has not recorded yet (a follower admitted together with it, or a run that failed) is computed in full.
Under a burst on a new template this turns every request after the first from a template run into a hit.

A template run that was itself an edit records its own masked tokens as invalid (they hold its edit, not the
template), so every later hit recomputes them. A hit whose mask leaves some of them unmasked computes them as
template context: it records those rows (a ``patch``) and, once it completes, a healed copy of the entry replaces
the old one, so later hits compute only their own masked tokens.

Rows reach the device through ``loader.RowLoader`` (block order, ahead of compute; a copy stream from pinned
memory on a GPU). ``overlap=False`` loads inside the block instead (the naive baseline). Entries are recorded and
stored in the model's dtype (a bf16 model's entries are half the bytes of float32 ones).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import logs
from .cost_model import CostModel
from .flux import FULL, KV, NOCTX, Y, FluxCacheHooks, Recorder, RowView, StepContext
from .heal import HEAL_MIN_RATIO, worth_healing
from .loader import K_BUF, V_BUF, Y_ROWS, RowLoader
from .planner import MODES, plan
from .store import ActivationStore, Entry

log = logging.getLogger(__name__)

POLICIES = ("off", "planner", "planner_y", "all_y", "all_kv", "noctx")


@dataclass
class JobCache:
    status: str  # off | hit | record | full (nothing cacheable)
    key: str | None = None
    entry: "Entry | _Live | None" = None  # a hit's rows; a recording run's own entry in progress
    modes: list[str] = field(default_factory=list)
    needs_output: list[bool] = field(default_factory=list)
    idx_c: torch.Tensor | None = None
    idx_u: torch.Tensor | None = None
    idx_u_np: np.ndarray | None = None
    recorder: Recorder | None = None
    valid: np.ndarray | None = None
    predicted_ms: float | None = None
    futures: dict = field(default_factory=dict)
    load_s: float = 0.0
    text_len: int = 0
    live: Recorder | None = None  # following a template run in progress: its recorder
    patch: Recorder | None = None  # rows of the invalid tokens this hit leaves unmasked, to heal the entry
    heal: np.ndarray | None = None  # those tokens
    patch_pos: torch.Tensor | None = None  # their positions among idx_c
    full_steps: int = 0  # steps a follower computed in full (the run had not recorded them)

    def ready(self, step: int) -> bool:
        """Are this hit's rows for ``step`` there? Always for a stored entry; for a follower once the run has
        recorded that step."""
        return self.live is None or self.live.step > step

    def info(self) -> dict:
        cached = [i for i, m in enumerate(self.modes) if m != FULL] if self.status == "hit" else []
        return {"cache": self.status, "cache_hit": self.status == "hit", "cached_blocks": cached,
                "cache_source": ("live" if self.live is not None else "store") if self.status == "hit" else None,
                "full_steps": self.full_steps,
                "block_modes": "".join({FULL: "F", Y: "Y", KV: "K", NOCTX: "N"}[m] for m in self.modes)
                if self.status == "hit" else "",
                "computed_tokens": int(self.idx_c.numel()) if self.idx_c is not None else None,
                "healed_tokens": int(self.heal.size) if self.patch is not None and self.patch.complete else 0}


@dataclass
class _Live:
    """A template run in progress, readable like a store ``Entry`` (meta, arrays, ``tensor``) by its followers."""

    meta: dict
    arrays: dict
    recorder: Recorder
    pinned: bool = True  # the recorder's buffers are page-locked on a GPU

    def tensor(self, name: str) -> torch.Tensor:
        return self.arrays[name]

    def step_event(self, step: int):
        """Step ``step``'s rows have landed in host memory (GPU: an event on the recording stream)."""
        return self.recorder.step_event(step)


class CacheRuntime:
    def __init__(self, hooks: FluxCacheHooks, store: ActivationStore | None, cost: CostModel | None = None,
                 policy: str = "planner", overlap: bool = True, budget_bytes: int = 1 << 30, record: bool = True,
                 heal_min_ratio: float = HEAL_MIN_RATIO):
        if policy not in POLICIES:
            raise ValueError(f"cache policy must be one of {POLICIES}")
        self.hooks, self.store, self.policy = hooks, store, policy
        self.cost = cost or CostModel.fallback()
        self.budget_bytes, self.record = int(budget_bytes), record
        cfg = hooks.transformer.config
        self.dim = cfg.num_attention_heads * cfg.attention_head_dim
        self.heads = cfg.num_attention_heads
        self.kinds = ["dual"] * hooks.n_dual + ["single"] * (len(hooks.blocks) - hooks.n_dual)
        param = next(hooks.transformer.parameters())
        self.device, self.dtype = param.device, param.dtype  # rows are recorded, stored and loaded in these
        self.itemsize = param.element_size()
        self.loader = RowLoader(self.device, self.heads, cfg.attention_head_dim, overlap=overlap)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="cache-writer")
        self._recording: dict[str, _Live] = {}  # key -> its template run in progress (until saved)
        self.heal_min_ratio = heal_min_ratio
        self._healing: set[str] = set()  # keys with a heal in progress (one at a time per key)
        self._mu = threading.Lock()

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, job) -> JobCache:
        x = job.inputs
        key = getattr(x, "cache_key", None)
        if self.policy == "off" or self.store is None or not key:
            jc = JobCache("off")
        else:
            try:
                jc = self._admit(job, key)
            except Exception:  # bad cache state never fails a request: compute in full
                log.exception("activation cache unusable for %s; running in full", key)
                jc = JobCache("off", key=key)
        if not jc.modes:
            jc.modes = [FULL] * len(self.kinds)
        job.state["cache"] = jc
        return jc

    def _admit(self, job, key: str) -> JobCache:
        x = job.inputs
        n, text = x.latents.shape[0], x.prompt_embeds.shape[0]
        if getattr(x, "register", False):
            return self._start_recording(job, key, n)
        entry = self.store.open(key)
        if entry is not None and not self._compatible(entry, n, x.steps):
            log.warning("activation entry %s does not fit this request (tokens/steps/dim); ignoring it", key)
            entry = None
        live = None
        if entry is None:
            with self._mu:
                live = self._recording.get(key)
            if live is None or not self._compatible(live, n, x.steps):
                return self._start_recording(job, key, n)
            entry = live
        valid = np.asarray(entry.arrays["valid"], dtype=bool)
        own = np.asarray(x.token_mask, bool)
        computed = own | ~valid
        if computed.all():
            return JobCache("full", key=key, entry=entry)
        dev = job.latents.device if job.latents is not None else "cpu"
        jc = JobCache("hit", key=key, entry=entry, valid=valid, text_len=text,
                      live=live.recorder if live is not None else None)
        idx_c = np.flatnonzero(computed)
        jc.idx_c = torch.from_numpy(idx_c).to(dev)
        jc.idx_u_np = np.flatnonzero(~computed)
        jc.idx_u = torch.from_numpy(jc.idx_u_np).to(dev)
        jc.modes, jc.predicted_ms = self._plan(entry, n, int(computed.sum()), text)
        jc.needs_output = self._needs_output(jc.modes)
        if live is None:
            self._maybe_heal(jc, x, ~valid & ~own, idx_c)
        return jc

    def _maybe_heal(self, jc: JobCache, x, heal: np.ndarray, idx_c: np.ndarray) -> None:
        """Record the rows of ``heal`` (invalid tokens this hit computes as template context, among ``idx_c``) if
        worth a rewrite."""
        if not self.record or self.policy == "noctx" or not worth_healing(heal, self.heal_min_ratio):
            return
        with self._mu:
            if jc.key in self._healing:
                return
            self._healing.add(jc.key)
        m = jc.entry.meta
        jc.heal = np.flatnonzero(heal)
        jc.patch = Recorder(x.steps, jc.heal.size, self.dim, self.dim, m["y_blocks"], m["kv_blocks"], self.dtype,
                            self.device)
        jc.patch_pos = torch.from_numpy(np.searchsorted(idx_c, jc.heal)).to(jc.idx_c.device)

    def _compatible(self, entry: Entry, n: int, steps: int) -> bool:
        m = entry.meta
        return m.get("tokens") == n and m.get("steps") == steps and m.get("dim") == self.dim and \
            m.get("blocks") == len(self.kinds)

    def _start_recording(self, job, key: str, n: int) -> JobCache:
        if not self.record:
            return JobCache("off", key=key)
        x = job.inputs
        inner = self.dim
        per_y = x.steps * n * self.dim * self.itemsize
        per_kv = x.steps * n * inner * self.itemsize * 2
        budget = self.budget_bytes
        y_blocks, kv_blocks = [], []
        for b in range(len(self.kinds)):
            if budget >= per_y:
                y_blocks.append(b)
                budget -= per_y
        for b in range(len(self.kinds)):
            if budget >= per_kv:
                kv_blocks.append(b)
                budget -= per_kv
        rec = Recorder(x.steps, n, self.dim, inner, y_blocks, kv_blocks, self.dtype, self.device)
        valid = ~np.asarray(x.token_mask, bool)  # tokens this request edits are not template context
        meta = {"tokens": n, "steps": x.steps, "dim": self.dim, "blocks": len(self.kinds), "n_dual": self.hooks.n_dual,
                "y_blocks": y_blocks, "kv_blocks": kv_blocks, "valid_tokens": int(valid.sum())}
        # The run's entry while it records: followers read it; once complete it is what the store saves.
        live = _Live(meta, {"y": rec.y, "k": rec.k, "v": rec.v, "valid": valid}, rec)
        with self._mu:
            if key in self._recording:  # a run of another shape (or a re-registration) is in progress
                return JobCache("off", key=key)
            self._recording[key] = live
        return JobCache("record", key=key, entry=live, recorder=rec, valid=valid)

    def recording(self, key: str | None) -> bool:
        """Is a template run of ``key`` in progress here (so a request on it would follow it)?"""
        with self._mu:
            return key is not None and key in self._recording

    def _plan(self, entry: Entry, n: int, c: int, text: int) -> tuple[list[str], float | None]:
        m = entry.meta
        has_y = [b in m["y_blocks"] for b in range(len(self.kinds))]
        has_kv = [b in m["kv_blocks"] for b in range(len(self.kinds))]
        if self.policy in ("planner", "planner_y"):
            row_bytes = n * self.dim * self.itemsize
            costs = self.cost.block_costs(self.kinds, n, c, text, self.dim, row_bytes, 2 * row_bytes, has_y, has_kv)
            p = plan(costs, MODES if self.policy == "planner" else (FULL, Y))
            return list(p.modes), p.latency_ms
        if self.policy == "all_y":
            return [Y if h else FULL for h in has_y], None
        if self.policy == "noctx":
            return [NOCTX if h else FULL for h in has_y], None
        # all_kv: kv where recorded; a kv block before a full/y block also needs its output rows
        modes = [KV if k else (Y if y else FULL) for y, k in zip(has_y, has_kv)]
        return modes, None

    @staticmethod
    def _needs_output(modes: list[str]) -> list[bool]:
        out = []
        for b, m in enumerate(modes):
            nxt = modes[b + 1] if b + 1 < len(modes) else None
            out.append(m in (Y, NOCTX) or (m == KV and (nxt is None or nxt in (FULL, Y, NOCTX))))
        return out

    # -- per step -----------------------------------------------------------------------------------
    def context(self, jobs) -> StepContext:
        views, hits = [], []
        for job in jobs:
            jc: JobCache = job.state["cache"]
            if jc.status == "record":
                views.append(RowView(modes=jc.modes, recorder=jc.recorder))
            elif jc.status == "hit" and jc.ready(job.step_index):
                views.append(RowView(modes=jc.modes, idx_c=jc.idx_c, idx_u=jc.idx_u, needs_output=jc.needs_output,
                                     rows=self.loader.rows(jc, job.step_index), patch=jc.patch,
                                     patch_pos=jc.patch_pos))
                hits.append((jc, job.step_index))
            else:
                if jc.status == "hit":  # a follower ahead of the run it follows: this step in full
                    jc.full_steps += 1
                views.append(None)
        self.loader.start_step(hits, self._needed)
        return StepContext(views)

    @staticmethod
    def _needed(jc: JobCache, b: int) -> list[str]:
        kinds = [K_BUF, V_BUF] if jc.modes[b] == KV else []
        if jc.needs_output[b]:
            kinds.append(Y_ROWS)
        return kinds

    def after_step(self, jobs) -> None:
        for job in jobs:
            jc = job.state.get("cache")
            if jc is not None and jc.recorder is not None:
                jc.recorder.next_step()
            if jc is not None and jc.patch is not None:
                jc.patch.next_step()

    def finish(self, job, ok: bool) -> None:
        """A job left the batch: save its recording (in the background) if it completed."""
        jc: JobCache | None = job.state.get("cache")
        if jc is None:
            return
        jc.futures.clear()
        if jc.status == "record":
            if ok and self.store is not None:
                self._writer.submit(self._save, jc, job.inputs)
            else:
                with self._mu:
                    self._recording.pop(jc.key, None)
        if jc.patch is not None:
            # Incomplete when a block ran in full for this request (the planner's choice) or it failed: no heal.
            if ok and jc.patch.complete and self.store is not None:
                self._writer.submit(self._heal, jc)
            else:
                with self._mu:
                    self._healing.discard(jc.key)

    def _save(self, jc: JobCache, x) -> None:
        live = jc.entry
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            jc.recorder.synchronize()  # its last device-to-host copies have landed
            self.store.put(jc.key, {**jc.recorder.tensors(), "valid": jc.valid.astype(np.uint8)},
                           {**live.meta, "dtype": str(self.dtype).removeprefix("torch.")})
            self.store.stats.record_cpu_s += self._wrote("recorded activations", jc.key, t0, c0,
                                                         bytes=jc.recorder.nbytes)
        except Exception:
            log.exception("could not save activations for %s", jc.key)
        finally:
            with self._mu:  # saved (or not): later requests open the store
                self._recording.pop(jc.key, None)

    def _heal(self, jc: JobCache) -> None:
        """Write a copy of the hit's entry with the patched rows in and those tokens valid, unless the entry
        changed meanwhile (rewritten, evicted): then its tokens may differ and the patch is dropped."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            entry = self.store.current(jc.key)
            if entry is not jc.entry:
                return
            p = jc.patch
            p.synchronize()
            t = torch.from_numpy(jc.heal)
            arrays = {name: entry.tensor(name).clone() for name in ("y", "k", "v", "valid")}  # own copies
            arrays["y"][:, :, t], arrays["k"][:, :, t], arrays["v"][:, :, t] = p.y, p.k, p.v
            arrays["valid"][t] = 1
            self.store.put(jc.key, arrays, {**entry.meta, "valid_tokens": int(arrays["valid"].sum())})
            self.store.stats.heals += 1
            self.store.stats.heal_cpu_s += self._wrote("healed activations", jc.key, t0, c0,
                                                     tokens=int(jc.heal.size))
        except Exception:
            log.exception("could not heal activations for %s", jc.key)
        finally:
            with self._mu:
                self._healing.discard(jc.key)

    @staticmethod
    def _wrote(msg: str, key: str, t0: float, c0: float, **fields) -> float:
        """Log a background write begun at ``t0`` (thread CPU ``c0``) with its wall and CPU time; returns the CPU
        seconds, which the caller adds to the store's stats (exported as a metric)."""
        cpu = time.thread_time() - c0
        logs.event(log, msg, key=key, **fields, wall_ms=round(1000 * (time.perf_counter() - t0), 1),
                   cpu_ms=round(1000 * cpu, 1))
        return cpu

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for pending recordings to be written (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        self.loader.close()
