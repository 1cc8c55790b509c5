"""One request's temporal-reuse state across its steps: what it last computed and what it reuses.

The decision rules are cache-dit's (``CachedContextManager.can_cache`` and ``similarity``, DBCache), applied to this
request alone; with ``fn=1, bn=0`` and no warm-up they are Diffusers' ``FirstBlockCache``. State changes are
staged during a step and committed only once the step succeeded (``commit``): a step that failed and is retried
alone (``DenoiseEngine._step``) decides exactly as the first try did.

A request whose family makes a second transformer call per step (the negative prompt's, true classifier-free
guidance) has a second state for that call's stream (``TemporalState.uncond``, the stream ``UNCOND``): its own
residuals, threshold decisions and TaylorSeer states, as Diffusers' hooks keep one state per ``cache_context``
("cond" / "uncond") and cache-dit with ``enable_separate_cfg`` its ``*_cfg`` buffers and calibrators.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from maskedit_common.temporal import TemporalSpec, check_blocks, computed_fraction
from maskedit_common.temporal import parse as parse_spec

from ..cache.modes import KV, Y
from ..errors import InvalidInput

COMPUTED, REUSED = "C", "R"
COND, UNCOND = "cond", "uncond"  # a request's streams: the prompt's call, the negative prompt's (true CFG)


@dataclass
class Staged:
    """What one step of one request will commit: its outcome and the tensors it computed."""

    outcome: str = COMPUTED
    fn_residual: torch.Tensor | None = None  # the first blocks' residual on a computed step (the next decision's)
    residual: tuple | None = None  # (image, text) residual of the middle blocks on a computed step
    diff: float | None = None


@dataclass
class TemporalState:
    spec: TemporalSpec
    n_blocks: int
    active: bool = True  # False: this request computes every block (why: ``note``)
    note: str = ""
    fn_residual: torch.Tensor | None = None  # the first blocks' residual at the last computed step
    residual: tuple | None = None  # (image, text) middle residual at the last computed step
    taylor: tuple | None = None  # cache-dit ``TaylorSeerState`` per stream (image, text) when ``spec.order``
    outcomes: list[str] = field(default_factory=list)  # per step taken: C (computed) or R (middle reused)
    diffs: list = field(default_factory=list)
    uncond: "TemporalState | None" = None  # the negative prompt's call's own state (the prompt's state holds it)

    @property
    def first(self) -> int:
        """The first middle block (skipped on a reused step)."""
        return self.spec.fn

    @property
    def tail(self) -> int:
        """The last middle block: where a reused step's residual is applied."""
        return self.n_blocks - self.spec.bn - 1

    # -- deciding -----------------------------------------------------------------------------------
    def static_decision(self, step: int) -> bool | None:
        """Reuse at ``step`` (a step mask decides before the step), or None (the first blocks' residual decides)."""
        if not self.active:
            return False
        computes = self.spec.computes(step)
        return None if computes is None else (not computes and self.residual is not None)

    def can_reuse(self, step: int, fn_residual: torch.Tensor) -> tuple[bool, float | None]:
        """cache-dit's ``can_cache`` for a threshold policy: warm-up, cached-step limits, then the relative L1
        change of the first blocks' residual against the last computed step's (``similarity``) under the
        threshold. Returns (reuse, the change measured)."""
        s = self.spec
        if not self.active or self.residual is None or step < s.warmup:
            return False, None
        reused = self.outcomes.count(REUSED)
        if 0 <= s.max_cached_steps <= reused:
            return False, None
        run = 0
        for o in reversed(self.outcomes):
            if o != REUSED:
                break
            run += 1
        if 0 <= s.max_continuous_cached_steps <= run:
            return False, None
        prev = self.fn_residual
        if s.threshold <= 0.0 or prev is None or prev.shape != fn_residual.shape:
            return False, None
        diff = ((prev - fn_residual).abs().mean() / prev.abs().mean()).item()
        return diff < s.threshold, diff

    def forecast(self, step: int, shape_of) -> tuple | None:
        """The middle residual a reused ``step`` adds: the last computed one, or its TaylorSeer forecast; None
        when it does not fit the rows computed now (``shape_of``: (image, text) shapes; None: not checked)."""
        if self.residual is None or (shape_of is not None and tuple(t.shape for t in self.residual) != shape_of):
            return None
        if self.taylor is None:
            return self.residual
        out = []
        for st in self.taylor:
            st.current_step = _taylor_step(step)
            out.append(st.approximate())
        return tuple(out)

    # -- committing ---------------------------------------------------------------------------------
    def commit(self, step: int, staged: Staged) -> None:
        self.outcomes.append(staged.outcome)
        self.diffs.append(None if staged.diff is None else round(staged.diff, 6))
        if staged.outcome != COMPUTED:
            return
        if staged.fn_residual is not None:
            self.fn_residual = staged.fn_residual
        if staged.residual is not None:
            self.residual = staged.residual
            if self.taylor is not None:
                for st, y in zip(self.taylor, staged.residual):
                    st.current_step = _taylor_step(step)
                    st.update(y)

    # -- reporting ----------------------------------------------------------------------------------
    def info(self) -> dict:
        """EDIT_INFO: the policy, which steps computed (C) or reused (R) their middle blocks, the blocks computed
        on a reused step and the fraction of block evaluations computed. With a negative prompt's call of its own
        (``uncond``): ``temporal_steps`` / ``temporal_reused_steps`` are the prompt's call's,
        ``temporal_uncond_steps`` / ``temporal_uncond_reused_steps`` the negative call's, and
        ``temporal_computed_fraction`` counts both calls' block evaluations."""
        reused = self.outcomes.count(REUSED)
        frac = self._fraction()
        out = {"temporal": self.spec.as_dict(), "temporal_steps": "".join(self.outcomes),
               "temporal_reused_steps": reused,
               "temporal_blocks": {"first": self.spec.fn, "last": self.spec.bn, "of": self.n_blocks}}
        u = self.uncond
        if u is not None:
            out["temporal_uncond_steps"] = "".join(u.outcomes)
            out["temporal_uncond_reused_steps"] = u.outcomes.count(REUSED)
            n, m = len(self.outcomes), len(u.outcomes)
            frac = (frac * n + u._fraction() * m) / (n + m) if n + m else 1.0
        out["temporal_computed_fraction"] = round(frac, 6)
        if self.note:
            out["temporal_note"] = self.note
        return out

    def _fraction(self) -> float:
        """The fraction of this stream's block evaluations computed so far."""
        if not self.outcomes:
            return 1.0
        return computed_fraction(self.spec, len(self.outcomes), self.n_blocks, self.outcomes.count(REUSED))


def of(job, stream: str = COND) -> "TemporalState | None":
    """``job``'s state for ``stream``: the prompt's call's (``COND``) or the negative prompt's (``UNCOND``)."""
    st = getattr(job, "temporal", None)
    return st if stream == COND or st is None else st.uncond


def admit(runner, job) -> None:
    """Give ``job`` its temporal state (or none) once it is admitted and its cache decision carried out. A bad
    spec for this model fails this request only (``InvalidInput`` naming TEMPORAL)."""
    raw = job.inputs.temporal
    # a step mask's indices count the steps it runs (STRENGTH < 1: the schedule's last ones), as the loop counts them
    runs = job.inputs.steps - getattr(job.inputs, "first_step", 0)
    spec = raw if isinstance(raw, TemporalSpec) else _parse(raw, runs)
    if not spec.on:
        job.temporal = None
        return
    family = runner.family
    if not getattr(family, "temporal_reuse", False):
        raise InvalidInput(f"{family.pipeline_class_name} models do not serve temporal reuse yet; leave TEMPORAL "
                           "out (docs/caching.md, Temporal reuse)", "TEMPORAL")
    hooks = family.temporal_hooks(runner.transformer)
    n_blocks = len(hooks.blocks)
    try:
        check_blocks(spec, n_blocks)
    except ValueError as e:
        raise InvalidInput(str(e), "TEMPORAL") from None
    why = hooks.check(spec) if hasattr(hooks, "check") else None
    if why:
        raise InvalidInput(why, "TEMPORAL")
    st = _state(spec, n_blocks)
    jc = job.cache
    if jc is not None and jc.status == "record":
        st.active, st.note = False, "a template run records every block"
    elif jc is not None and jc.status == "hit" and not getattr(hooks, "features", False) and \
            any(m not in (Y, KV) for m in jc.modes[st.first:st.tail + 1]):
        st.active, st.note = False, "the hit's plan runs a middle block in full"
    # The negative prompt's call (true classifier-free guidance) runs uncached, every token: its stream reuses
    # whatever the cache decided for the prompt's call. ``temporal_negative_call``: the family makes that call
    # through its block hooks with ``negative``'s context (default: no such call, or one that always computes).
    negative = getattr(family, "temporal_negative_call", None)
    if negative is not None and negative(job):
        st.uncond = _state(spec, n_blocks)
    job.temporal = st


def _state(spec: TemporalSpec, n_blocks: int) -> TemporalState:
    st = TemporalState(spec, n_blocks)
    if spec.order:
        from cache_dit.caching.cache_contexts.calibrators.taylorseer import TaylorSeerState  # imported when used

        st.taylor = (TaylorSeerState(n_derivatives=spec.order), TaylorSeerState(n_derivatives=spec.order))
    return st


def _taylor_step(step: int) -> int:
    """The step number cache-dit's ``TaylorSeerState`` would hold at ``step``. Its calibrator advances every state
    with ``mark_step_begin`` at each step, but creates a state at its first ``update``, after that step's
    advance: its count runs one behind the step index (which matters where it starts derivatives, ``> 1``). Ours
    is set explicitly (a retried step must not advance it twice), numbered as cache-dit's so results equal it."""
    return step - 1


def _parse(raw, steps: int) -> TemporalSpec:
    try:
        return parse_spec(raw, steps)
    except ValueError as e:
        raise InvalidInput(str(e), "TEMPORAL") from None
