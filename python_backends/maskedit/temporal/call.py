"""Temporal reuse inside one denoiser call: which rows (requests) skip which blocks, and their residuals.

The block hooks of a family (``maskedit.cache.flux``, the FLUX.2 hooks) consult the call's ``TemporalCall`` through
the step context (``StepContext.temporal``): ``enter`` as a block starts (capturing a row's input where a residual
begins), ``skipped`` for the rows that pass a middle block through unchanged, ``exit`` as it ends (deciding a
threshold row after the first blocks, recording or applying the middle residual at the last middle block). Each
call hands the hooks an image tensor (the tokens a residual covers) and a text tensor per block.

Residuals cover the rows' computed image tokens: every token for a plain row, the first ``tokens`` of a packed one,
a cache hit's computed tokens (``idx_c``; the family may add tokens it always computes, ``temporal_cols``). On a
reused step a hit's unmasked rows of the last middle block come from its activation entry, as on a computed step.

A family whose step makes a second call with the negative prompts (true classifier-free guidance) runs it with
``TemporalCall.negative``'s context: the rows' second stream (``state.UNCOND``), decided, reused and committed on
its own, as the stock pipelines do under Diffusers' hooks (``cache_context("uncond")``) or cache-dit's
``enable_separate_cfg``. That call runs uncached (every token), so its context carries the temporal call only.
"""

from __future__ import annotations

import torch

from ..cache.modes import FULL, StepContext
from .state import COMPUTED, COND, REUSED, UNCOND, Staged, of


class _Row:
    """One request's part of the call."""

    def __init__(self, job, stream: str = COND):
        self.job, self.state, self.stream = job, of(job, stream), stream
        self.step = _loop_step(job)
        self.reuse: bool | None = self.state.static_decision(self.step)  # None: decided after the first blocks
        self.staged = Staged()
        self.x0 = None  # image input of block 0 at its columns (threshold rows)
        self.fn_residual = None  # the first blocks' residual this step (threshold rows)
        self.shapes = None
        self.h_in = None  # (image, text) input of the first middle block
        self.residual = None  # what a reused step adds


class TemporalCall:
    """The temporal side of one denoiser call over ``jobs`` (batch rows in order) for their ``stream`` (the
    prompt's call, or the negative prompt's); rows without reuse are None. The prompt's call holds the negative
    call's (``uncond``) when a job has that stream."""

    def __init__(self, jobs: list, hooks, stream: str = COND):
        per_job = getattr(hooks, "temporal_rows", lambda job: 1)  # batch rows of a job (a UNet's guidance rows)
        self.rows = [row for j in jobs for row in [_Row(j, stream) if _active(j, stream) else None] * per_job(j)]
        self.hooks = hooks  # the family's block hooks (``temporal_cols``)
        self.stream = stream
        self.uncond: TemporalCall | None = None
        self._cols: dict = {}

    @property
    def active(self) -> bool:
        return any(r is not None for r in self.rows)

    def negative(self, rows: list[int] | None = None) -> StepContext | None:
        """The step context of the negative prompts' call (true classifier-free guidance) over batch rows ``rows``
        of this (the prompt's) call (None: all): plain rows (that call runs uncached) carrying their negative
        stream's temporal call; None when no row reuses on it (the call runs as it would without temporal reuse).
        Families reach it through the step context (``ctx.temporal.negative``), as the hooks reach ``enter``."""
        if self.uncond is None:
            return None
        sub = self.uncond if rows is None else self.uncond.subset(rows)
        if not sub.active:
            return None
        return StepContext([None] * len(sub.rows), temporal=sub)

    def subset(self, idx: list[int]) -> "TemporalCall":
        """The same rows for a call over batch rows ``idx`` (a family that splits one step into several calls)."""
        sub = TemporalCall.__new__(TemporalCall)
        sub.rows, sub.hooks, sub._cols = [self.rows[i] for i in idx], self.hooks, {}
        sub.stream, sub.uncond = self.stream, self.uncond.subset(idx) if self.uncond is not None else None
        return sub

    # -- what a row's residual covers ------------------------------------------------------------------
    def _columns(self, ctx: StepContext, i: int, n_img: int):
        """Image columns of row ``i``'s residuals: None (all), an int (the first ``n``: a packed row) or an index
        tensor (a hit's computed tokens)."""
        if i not in self._cols:
            view = ctx.rows[i] if i < len(ctx.rows) else None
            if view is None:
                cols = None
            elif view.idx_c is not None:
                cols = self.hooks.temporal_cols(view, n_img)
            else:
                cols = view.tokens if ctx.packed and view.tokens is not None else None
            self._cols[i] = cols
        return self._cols[i]

    @staticmethod
    def _take(t: torch.Tensor, i: int, cols) -> torch.Tensor:
        if cols is None:
            return t[i]
        if isinstance(cols, int):
            return t[i, :cols]
        return t[i, cols]

    @staticmethod
    def _put(t: torch.Tensor, i: int, cols, value: torch.Tensor) -> None:
        if cols is None:
            t[i] = value
        elif isinstance(cols, int):
            t[i, :cols] = value
        else:
            t[i, cols] = value

    # -- the hooks' side ---------------------------------------------------------------------------------
    def skipped(self, b: int) -> list[int]:
        """Batch rows that pass block ``b`` through unchanged (a middle block of a reused step)."""
        return [i for i, r in enumerate(self.rows)
                if r is not None and r.reuse and r.state.first <= b <= r.state.tail]

    def enter(self, ctx: StepContext, b: int, img: torch.Tensor, txt: torch.Tensor | None) -> None:
        for i, r in enumerate(self.rows):
            if r is None:
                continue
            st = r.state
            if b == 0 and r.reuse is None:
                r.x0 = self._take(img, i, self._columns(ctx, i, img.shape[1])).clone()
            if b != st.first:
                continue
            if r.reuse is None:  # not decided by its first blocks (none ran): computed
                r.reuse = False
            self._capture(ctx, r, i, img, txt)
            if r.reuse:
                r.residual = st.forecast(r.step, r.shapes)
                if r.residual is None:  # its rows changed since its last computed step (a follower caught up)
                    r.reuse = False
                    r.staged.fn_residual = r.fn_residual
                else:
                    self._cancel_loads(r, b, st.tail)

    def exit(self, ctx: StepContext, b: int, img: torch.Tensor, txt: torch.Tensor | None) -> None:
        for i, r in enumerate(self.rows):
            if r is None:
                continue
            st = r.state
            if b == st.first - 1 and r.reuse is None:  # the first blocks ran: a threshold row decides
                r.fn_residual = self._take(img, i, self._columns(ctx, i, img.shape[1])) - r.x0
                r.x0 = None
                r.reuse, r.staged.diff = st.can_reuse(r.step, r.fn_residual)
                if not r.reuse:
                    r.staged.fn_residual = r.fn_residual
            if b != st.tail or r.h_in is None:
                continue
            cols = self._columns(ctx, i, img.shape[1])
            h_img, h_txt = r.h_in
            if r.reuse:
                r.staged.outcome = REUSED
                self._put(img, i, cols, h_img + r.residual[0])
                if txt is not None:
                    txt[i] = h_txt + r.residual[1]
                self._cached_rows(ctx, i, b, img)
            else:
                r.staged.residual = (self._take(img, i, cols) - h_img,
                                     (txt[i] - h_txt) if txt is not None else img.new_zeros(()))
            r.h_in = None

    # -- blocks that change the tensor's shape (a UNet's): the middle blocks' output itself is reused -----------
    def _groups(self) -> list:
        """(row, its batch rows) per reusing request."""
        out: dict = {}
        for i, r in enumerate(self.rows):
            if r is not None:
                out.setdefault(id(r), (r, []))[1].append(i)
        return list(out.values())

    def exit_features(self, b: int, out: torch.Tensor) -> None:
        """After block ``b`` of a model whose blocks change shape: a threshold row decides from the first blocks'
        output (cache-dit's hidden-states L1 mode; a residual across them is undefined), and the last middle block's
        output is recorded on a computed step and replaced by the recorded one on a reused step (DeepCache)."""
        for r, idx in self._groups():
            st = r.state
            if b == st.first - 1 and r.reuse is None:
                h = out[idx]
                r.reuse, r.staged.diff = st.can_reuse(r.step, h)
                if not r.reuse:
                    r.staged.fn_residual = h.clone()
            if b == st.first - 1 and r.reuse:
                r.residual = st.forecast(r.step, None)
                if r.residual is None:
                    r.reuse = False
                else:  # a hit's cached rows for the skipped blocks' transformer blocks are not needed
                    self._cancel_loads(r, *self.hooks.inner_blocks(st.first, st.tail))
            if b != st.tail:
                continue
            if r.reuse:
                r.staged.outcome = REUSED
                out[idx] = r.residual[0]
            else:
                r.staged.residual = (out[idx].clone(), out.new_zeros(()))

    # -- helpers ---------------------------------------------------------------------------------------
    def _capture(self, ctx, r: _Row, i: int, img, txt) -> None:
        cols = self._columns(ctx, i, img.shape[1])
        r.h_in = (self._take(img, i, cols).clone(), txt[i].clone() if txt is not None else None)
        r.shapes = (r.h_in[0].shape, r.h_in[1].shape if txt is not None else torch.Size([]))

    def _cached_rows(self, ctx, i: int, b: int, img: torch.Tensor) -> None:
        """A hit's unmasked rows of the last middle block, from its entry where the next block reads them."""
        view = ctx.rows[i] if i < len(ctx.rows) else None
        if view is None or view.modes[b] == FULL or not view.needs_output[b]:
            return
        rows = view.rows(b, "y")
        img[i, view.idx_u] = rows[view.idx_u]

    @property
    def hooks_features(self) -> bool:
        return getattr(self.hooks, "features", False)

    def _cancel_loads(self, r: _Row, first: int, tail: int) -> None:
        """A hit skipping its middle blocks needs none of their cached rows but the last one's output: drop the
        loads queued for them (the loader skips those not started)."""
        jc = getattr(r.job, "cache", None)
        if r.stream != COND or jc is None or not jc.futures:  # the negative call reads no cached rows
            return
        for key in [k for k in jc.futures if k[0] == r.step and first <= k[1] <= tail and
                    not (k[1] == tail and k[2] == "y" and not self.hooks_features)]:
            jc.futures.pop(key).cancel()


def attach(ctx: StepContext | None, jobs: list, hooks) -> StepContext | None:
    """``ctx`` (made for a plain call when None) carrying the temporal side of a call over ``jobs`` (the negative
    prompt's call's too, for ``negative``); ``ctx`` as it was when no job reuses. ``hooks()``: the family's block
    hooks on the denoiser."""
    cond, uncond = (any(_active(j, s) for j in jobs) for s in (COND, UNCOND))
    if not (cond or uncond):
        return ctx
    h = hooks()
    call = TemporalCall(jobs, h)
    if uncond:
        call.uncond = TemporalCall(jobs, h, UNCOND)
    if ctx is None:
        ctx = StepContext([None] * len(jobs))
    ctx.temporal = call
    return ctx


def commit(ctx: StepContext | None, jobs: list) -> None:
    """The step succeeded: every row's staged outcome becomes its state, on both streams; rows without reuse this
    step count as computed (a negative call made without ``negative``'s context computed every block)."""
    call = ctx.temporal if ctx is not None else None
    for stream, c in ((COND, call), (UNCOND, call.uncond if call is not None else None)):
        rows = {id(r.job): r for r in c.rows if r is not None} if c is not None else {}
        for job in jobs:
            st = of(job, stream)
            if st is None:
                continue
            r = rows.get(id(job))
            step = _loop_step(job) - 1  # the family's step advanced it
            st.commit(step, r.staged if r is not None else Staged(COMPUTED))


def _active(job, stream: str) -> bool:
    st = of(job, stream)
    return st is not None and st.active


def loads(jobs: list, hooks):
    """For the cache's loader (``CacheRuntime.context``): the cached rows a hit will not read this step because its
    step mask reuses its middle blocks (the last one's output rows stay, on token-row families); None when no hit
    of ``jobs`` skips. A decision undone later (its rows changed) loads what it needs in the block."""
    skips = {}
    for j in jobs:
        st, jc = j.temporal, getattr(j, "cache", None)
        if st is None or jc is None or jc.status != "hit" or not st.static_decision(_loop_step(j)):
            continue
        features = getattr(hooks, "features", False)
        lo, hi = hooks.inner_blocks(st.first, st.tail) if features else (st.first, st.tail)
        skips[id(jc)] = (lo, hi, not features)
    if not skips:
        return None

    def keep(jc, b: int, kinds: list) -> list:
        s = skips.get(id(jc))
        if s is None or not s[0] <= b <= s[1]:
            return kinds
        return [k for k in kinds if s[2] and b == s[1] and k == "y"]

    return keep


def _loop_step(job) -> int:
    """The step in the loop the request runs, as the stock pipeline's loop (and cache-dit's step count) number it:
    a STRENGTH < 1 edit's first step is 0 there, whatever schedule step it starts at."""
    return job.step_index - getattr(job.inputs, "first_step", 0)
