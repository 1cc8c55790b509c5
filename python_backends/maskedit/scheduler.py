"""Which waiting requests join the running batch at the next step boundary.

Kept apart from the loop (``engine.py``) and the model runner (``denoise.py``), as in nano-vllm / vLLM:
the scheduler only decides. Policies:
- ``continuous``: after every step, admit waiting requests while the batch has room (``max_batch``) and the
  step's token budget (``max_tokens``: computed image tokens summed over the batch) allows;
- ``static``: admit only into an empty batch, then run it to completion (the baseline).
Waiting requests are taken by least slack (deadline − now − predicted remaining time; no deadline = infinite
slack, then arrival order). A request that cannot meet its deadline even if started now is rejected early with
DEADLINE_EXCEEDED (``reject_late``), never silently dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import DeadlineExceeded


@dataclass
class StepTimeModel:
    """Seconds per denoising step ≈ fixed + per_token × computed tokens in the batch; refit online (EMA)."""

    fixed_s: float = 0.01
    per_token_s: float = 2e-4
    alpha: float = 0.2

    def predict(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        per_token = max(0.0, (seconds - self.fixed_s) / tokens)
        self.per_token_s += self.alpha * (per_token - self.per_token_s)


class BatchScheduler:
    POLICIES = ("continuous", "static")

    def __init__(self, policy: str = "continuous", max_batch: int = 4, max_tokens: int = 1 << 30,
                 reject_late: bool = True, model: StepTimeModel | None = None):
        if policy not in self.POLICIES:
            raise ValueError(f"batching policy must be one of {self.POLICIES}")
        self.policy, self.max_batch, self.max_tokens = policy, max_batch, max_tokens
        self.reject_late = reject_late
        self.model = model or StepTimeModel()

    def remaining_s(self, job, batch_tokens: int | None = None) -> float:
        """Predicted time to finish ``job`` if it ran in a batch of ``batch_tokens`` computed tokens."""
        tokens = batch_tokens if batch_tokens is not None else job.tokens
        return (job.steps - job.step_index) * self.model.predict(tokens)

    def slack(self, job, now: float) -> float:
        if job.deadline is None:
            return float("inf")
        return job.deadline - now - self.remaining_s(job)

    def late(self, job, now: float) -> DeadlineExceeded | None:
        if self.reject_late and job.deadline is not None and now + self.remaining_s(job) > job.deadline:
            return DeadlineExceeded(
                f"cannot finish before its deadline: {max(0.0, job.deadline - now) * 1000:.0f} ms left, "
                f"~{self.remaining_s(job) * 1000:.0f} ms of denoising needed", "DEADLINE_MS")
        return None

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
        candidates.sort(key=lambda j: (self.slack(j, now), j.submitted_at))
        chosen = []
        tokens = sum(j.tokens for j in running)
        for job in candidates:
            if len(running) + len(chosen) >= self.max_batch:
                break
            if (running or chosen) and tokens + job.tokens > self.max_tokens:
                continue  # a smaller request further back may still fit
            chosen.append(job)
            tokens += job.tokens
        return chosen, rejected
