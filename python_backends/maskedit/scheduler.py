"""Which waiting requests join the running batch at the next step boundary.

Kept apart from the loop (``engine.py``) and the model runner (``denoise.py``), as in nano-vllm / vLLM:
the scheduler only decides. Policies:
- ``continuous``: after every step, admit waiting requests while the batch has room (``max_batch``) and the
  step's token budget (``max_tokens``: computed image tokens summed over the batch) allows;
- ``static``: admit only into an empty batch, then run it to completion (the baseline);
- ``priority``: for GPUs, where a step of b requests costs about b steps of one (the big kernels do not batch at
  Flux sizes), so what matters is *which* requests advance. Every step, the admitted requests and the waiting ones
  compete: urgent deadlines first (least slack), then least remaining work (shortest-remaining-processing-time over
  token-steps: a 10 %-mask hit goes before a full template run), within ``max_batch`` and the token budget
  ``max_tokens``. Admitted requests that lose are paused at the step boundary (preempted; their state stays) and
  resume later. No starvation: a request left idle ``max_wait_steps`` steps goes first (longest idle first), so
  once admitted it advances at least once every ``max_wait_steps + ceil(max_active / max_batch)`` steps. At most
  ``max_active`` requests are admitted (prepared on the device) at once.
Waiting requests are taken by least slack (deadline − now − predicted remaining time; no deadline = infinite
slack, then arrival order). A request that cannot meet its deadline even if started now is rejected early with
DEADLINE_EXCEEDED (``reject_late``), never silently dropped. Its bound (``maskedit.completion``: the server's
``MASKEDIT_LATENCY_BOUND_S`` or its DEADLINE_MS, counted from its arrival) is checked too, when it would join the
batch, with the batch it would join: a request that waited so long that it can no longer be answered in time is
refused then (RESOURCE_EXHAUSTED; DEADLINE_EXCEEDED for its own DEADLINE_MS), never started and answered late; one
that would make a request in the batch late waits for the next step. And one in the batch that can no longer be
answered in time (the host turned slower than predicted) ends before its next step (``overdue``, DEADLINE_EXCEEDED).
The bound orders nothing: the order stays the deadlines' and the tenants' (``maskedit.fair_share``).

``select`` returns a ``SchedulerOutput``: the contract between the scheduler and the loop (as vLLM v1's), saying
which requests to admit, which to step and which are paused.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from . import completion
from .errors import DeadlineExceeded, ResourceExhausted


@dataclass
class StepTimeModel:
    """Seconds per denoising step ≈ fixed + per_token × computed tokens in the batch; refit online from the loop's
    real step times (on a loaded host, its slowdown is in them).

    Both parts are fitted. The level — the step time at the recent batches' tokens — is an EMA (``alpha``) of the
    steps; the slope (per token) an exponentially weighted least-squares fit over a longer memory (``slope_alpha``),
    kept as it was while the batches' tokens barely vary (nothing to fit it from); fixed = level − slope × tokens.
    Fitting only the per-token part (the fixed part a constant 10 ms) charged a step's whole time to its tokens: on
    the tiny CPU model a step of 24 tokens takes about what one of 256 takes, so a step of 24 measured at 0.1 s
    predicted 1 s for 256, and a flood's requests were refused as taking minutes when one took seconds.

    A step is counted as at most ``clamp`` times the estimate: one outlier (the process stopped mid-step for 10 s)
    raises the level by at most ``1 + alpha * (clamp - 1)`` times and is forgotten within a few steps, while a loaded
    host's frequent slow steps (tens of times the usual on a shared 2-core machine) still count in full once the
    estimate has risen with them: what matters for a request's completion is the mean step time, tail included."""

    fixed_s: float = 0.01
    per_token_s: float = 2e-4
    alpha: float = 0.2
    clamp: float = 20.0
    slope_alpha: float = 0.05
    # the fit's state: the level's EMAs of tokens and seconds; the slope's weighted means, variance and covariance
    _level: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _slope: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def predict(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        expected = self.predict(tokens)
        if expected > 0:
            seconds = min(seconds, self.clamp * expected)
        mx, my = self._level or (tokens, expected)  # the first step moves the estimate as any other does
        mx, my = mx + self.alpha * (tokens - mx), my + self.alpha * (seconds - my)
        self._level = (mx, my)
        sx, sy, vx, cxy = self._slope or (tokens, seconds, 0.0, 0.0)
        a, dx, dy = self.slope_alpha, tokens - sx, seconds - sy  # West's weighted (co)variance update
        sx, sy = sx + a * dx, sy + a * dy
        vx, cxy = (1 - a) * (vx + a * dx * dx), (1 - a) * (cxy + a * dx * dy)
        self._slope = (sx, sy, vx, cxy)
        if vx > (0.1 * sx) ** 2:  # the tokens varied enough (a tenth of their mean) to tell fixed from per token
            self.per_token_s = max(0.0, cxy / vx)
        self.fixed_s = my - self.per_token_s * mx
        if self.fixed_s < 0:  # a slope steeper than the level allows: all of it per token
            self.fixed_s, self.per_token_s = 0.0, my / mx


HOLD = object()  # ``BatchScheduler.joins``: not this step


def _answer_by(job) -> float | None:
    """The ``time.time()`` by which ``job`` must be answered (its bound), or None."""
    return getattr(getattr(job, "inputs", None), "answer_by", None)


@dataclass
class SchedulerOutput:
    """One step's decision: waiting requests to admit (prepare), the requests to advance this step (admitted ones
    included), admitted requests paused this step, and waiting requests rejected with their error."""

    admitted: list = field(default_factory=list)
    step: list = field(default_factory=list)
    paused: list = field(default_factory=list)
    rejected: list = field(default_factory=list)


class BatchScheduler:
    POLICIES = ("continuous", "static", "priority")

    def __init__(self, policy: str = "continuous", max_batch: int = 4, max_tokens: int = 1 << 30,
                 reject_late: bool = True, model: StepTimeModel | None = None, max_wait_steps: int = 8,
                 max_active: int | None = None, urgent_steps: int = 4, decode_s=None):
        """``decode_s()``: one decoding's measured time, after the loop (``maskedit.completion``; default 0)."""
        if policy not in self.POLICIES:
            raise ValueError(f"batching policy must be one of {self.POLICIES}")
        self.policy, self.max_batch, self.max_tokens = policy, max_batch, max_tokens
        self.reject_late = reject_late
        self.model = model or StepTimeModel()
        self.max_wait_steps = max_wait_steps
        self.max_active = max_active or 2 * max_batch
        self.urgent_steps = urgent_steps  # "priority": slack under this many of its own predicted steps is urgent
        self.decode_s = decode_s or (lambda: 0.0)

    @property
    def wait_bound_steps(self) -> int:
        """Most steps an admitted request waits between two of its steps under ``priority``."""
        return self.max_wait_steps + math.ceil(self.max_active / self.max_batch)

    def select(self, waiting: list, running: list) -> SchedulerOutput:
        """This step's decision (``waiting``/``running`` are not modified; the loop applies it)."""
        if self.policy != "priority":
            admitted, rejected = self.admit(waiting, running)
            return SchedulerOutput(admitted, list(running) + admitted, [], rejected)
        return self._priority(waiting, running)

    def remaining_work(self, job) -> int:
        """Token-steps left: what a step loop whose step cost grows with the tokens it computes still owes."""
        return (job.steps - job.step_index) * max(1, job.tokens or 0)

    def _priority(self, waiting: list, running: list) -> SchedulerOutput:
        now = time.time()
        out = SchedulerOutput()
        candidates = []
        for job in waiting:
            err = self.late(job, now)
            if err is not None:
                out.rejected.append((job, err))
            else:
                candidates.append(job)

        def rank(job):
            idle = getattr(job, "idle_steps", 0)
            if idle >= self.max_wait_steps:
                return (0, -idle, job.submitted_at)  # starving: longest idle first
            slack = self.slack(job, now)
            if slack < self.urgent_steps * self.model.predict(job.tokens or 0):
                return (1, slack, job.submitted_at)  # a deadline close: least slack first
            return (2, self.remaining_work(job), job.submitted_at)

        active = set(map(id, running))
        tokens = 0
        for job in sorted(list(running) + candidates, key=rank):
            if len(out.step) >= self.max_batch:
                break
            if out.step and tokens + (job.tokens or 0) > self.max_tokens:
                continue  # a smaller request further down may still fit
            if id(job) not in active:
                if len(running) + len(out.admitted) >= self.max_active:
                    continue
                fit = self.joins(job, out.step, now)
                if fit is not None:
                    if fit is not HOLD:
                        out.rejected.append((job, fit))
                    continue
                out.admitted.append(job)
            out.step.append(job)
            tokens += job.tokens or 0
        stepped = set(map(id, out.step))
        out.paused = [j for j in running if id(j) not in stepped]
        return out

    def remaining_s(self, job, batch_tokens: int | None = None) -> float:
        """Predicted time to finish ``job`` if it ran in a batch of ``batch_tokens`` computed tokens."""
        tokens = batch_tokens if batch_tokens is not None else job.tokens
        return (job.steps - job.step_index) * self.model.predict(tokens)

    def slack(self, job, now: float) -> float:
        if job.deadline is None:
            return float("inf")
        return job.deadline - now - self.remaining_s(job)

    def late(self, job, now: float) -> DeadlineExceeded | ResourceExhausted | None:
        """Its error if it cannot meet its deadline, or be answered within its bound, even if it started now alone."""
        if self.reject_late and job.deadline is not None and now + self.remaining_s(job) > job.deadline:
            return DeadlineExceeded(
                f"cannot finish before its deadline: {max(0.0, job.deadline - now) * 1000:.0f} ms left, "
                f"~{self.remaining_s(job) * 1000:.0f} ms of denoising needed", "DEADLINE_MS")
        if self.reject_late and _answer_by(job) is not None and \
                now + self.remaining_s(job) + self.decode_s() > _answer_by(job):
            return self._too_late(job, now, self.remaining_s(job) + self.decode_s())
        return None

    def loop(self) -> completion.Loop:
        """The loop as ``maskedit.completion`` predicts it: the step-time model as measured, the batch's limits."""
        return completion.Loop(self.model.predict, self.max_batch, self.max_tokens, self.decode_s())

    def work(self, job, now: float) -> completion.Work:
        by = _answer_by(job)
        return completion.Work(job.steps - job.step_index, job.tokens or 0, math.inf if by is None else by - now)

    def joins(self, job, batch: list, now: float):
        """May ``job`` join ``batch`` now? None: yes; ``HOLD``: not this step (it would make one of them late);
        else its error: with that batch it can no longer be answered within its bound."""
        if not self.reject_late or _answer_by(job) is None:
            return None
        p = completion.predict(self.loop(), [self.work(j, now) for j in batch], [], self.work(job, now))
        if now + p.answer_s > _answer_by(job):
            return self._too_late(job, now, p.answer_s)
        return HOLD if p.delays else None

    def overdue(self, job, now: float, next_s: float):
        """Its error if ``job``, admitted, can no longer be answered within its bound: its next step (``next_s``,
        decoding included) would end past it. The host turned slower than predicted when it was taken; nobody waits
        for it after its bound (its caller's deadline passed, or the proxy in front gave up), so it ends now, an
        answer within the bound, rather than a result after it, and frees its place."""
        by = _answer_by(job)
        if not self.reject_late or by is None or now + next_s < by:
            return None
        bound_s = getattr(job.inputs, "bound_s", 0.0) or 0.0
        source = getattr(job.inputs, "bound_source", "") or completion.SERVER_BOUND
        return DeadlineExceeded(
            f"ran out of its bound of {bound_s:g} s after its arrival ({source}) with {job.steps - job.step_index} "
            f"steps left: the host turned slower than predicted when it was taken ("
            f"{1000 * self.model.predict(job.tokens or 0):.0f} ms a step measured now); ended before its next step",
            completion.CLIENT_BOUND if source == completion.CLIENT_BOUND else None)

    def _too_late(self, job, now: float, needed_s: float):
        bound_s = getattr(job.inputs, "bound_s", 0.0) or 0.0
        source = getattr(job.inputs, "bound_source", "") or completion.SERVER_BOUND
        arrived = _answer_by(job) - bound_s
        text = (f"waited {max(0.0, now - arrived):.1f} s since its arrival and can no longer be answered within "
                f"{bound_s:g} s of it (~{needed_s:.1f} s of work left, "
                f"{1000 * self.model.predict(job.tokens or 0):.0f} ms a step measured now); refused before it started")
        if source == completion.CLIENT_BOUND:
            return DeadlineExceeded(text, completion.CLIENT_BOUND)
        return ResourceExhausted(f"{text} ({completion.SERVER_BOUND}); retry later or send it to another server")

    def admit(self, waiting: list, running: list) -> tuple[list, list]:
        """(jobs to admit, (job, error) pairs to reject). ``waiting`` is not modified."""
        now = time.time()
        if self.policy == "static" and running:
            return [], []
        rejected, candidates = [], []
        for job in waiting:
            err = self.late(job, now)
            if err is not None:
                rejected.append((job, err))
            else:
                candidates.append(job)
        # equal slack (no deadlines: all infinite): tenants' fair-share order (``maskedit.fair_share``; tags 0
        # when it is off), first come first served within a tenant
        candidates.sort(key=lambda j: (self.slack(j, now), getattr(j, "fair_tag", 0.0), j.submitted_at))
        chosen = []
        tokens = sum(j.tokens for j in running)
        for job in candidates:
            if len(running) + len(chosen) >= self.max_batch:
                break
            if (running or chosen) and tokens + job.tokens > self.max_tokens:
                continue  # a smaller request further back may still fit
            fit = self.joins(job, list(running) + chosen, now)
            if fit is not None:
                if fit is not HOLD:
                    rejected.append((job, fit))
                continue
            chosen.append(job)
            tokens += job.tokens
        return chosen, rejected
