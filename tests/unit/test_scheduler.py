"""Admission decisions and the loop's batching behaviour."""

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from maskedit.denoise import DenoiseJob
from maskedit.engine import DenoiseEngine
from maskedit.errors import DeadlineExceeded
from maskedit.scheduler import BatchScheduler, StepTimeModel


def fake(tokens=100, steps=4, deadline=None, t=0.0):
    return SimpleNamespace(tokens=tokens, steps=steps, step_index=0, deadline=deadline, submitted_at=t)


def test_continuous_fills_up_to_max_batch_and_token_budget():
    s = BatchScheduler("continuous", max_batch=3, max_tokens=250)
    running = [fake(100)]
    chosen, rejected = s.admit([fake(100, t=1), fake(100, t=2), fake(40, t=3)], running)
    assert [j.submitted_at for j in chosen] == [1, 3] and not rejected  # the second 100 would exceed 250


def test_static_admits_only_into_an_empty_batch():
    s = BatchScheduler("static", max_batch=2)
    assert s.admit([fake()], [fake()]) == ([], [])
    chosen, _ = s.admit([fake(t=1), fake(t=2), fake(t=3)], [])
    assert len(chosen) == 2


def test_least_slack_first_and_early_rejection():
    m = StepTimeModel(fixed_s=0.0, per_token_s=0.001)  # 100 tokens x 4 steps = 0.4 s of work
    s = BatchScheduler("continuous", max_batch=1, model=m)
    now = time.time()
    relaxed, urgent, none = fake(deadline=now + 10, t=1), fake(deadline=now + 1, t=2), fake(t=0)
    chosen, _ = s.admit([relaxed, none, urgent], [])
    assert chosen == [urgent]
    hopeless = fake(deadline=now + 0.1)
    chosen, rejected = s.admit([hopeless], [])
    assert not chosen and rejected[0][0] is hopeless and isinstance(rejected[0][1], DeadlineExceeded)
    assert "DEADLINE_MS" in str(rejected[0][1])


def test_step_time_model_learns():
    m = StepTimeModel(fixed_s=0.0, per_token_s=1.0, alpha=0.5)
    for _ in range(20):
        m.observe(100, 0.1)
    assert m.predict(100) == pytest.approx(0.1, rel=0.01)


@pytest.fixture(scope="module")
def inputs(make_inputs):
    return make_inputs(6)


def _run_two(runner, inputs, policy):
    """Submit A, then B once A is running; return the step at which B joined and A's steps at that time."""
    eng = DenoiseEngine(runner, scheduler=BatchScheduler(policy, max_batch=4))
    seen = {}
    done = threading.Event()
    a = DenoiseJob(inputs, on_step=lambda j: seen.setdefault("a_steps", []).append(j.step_index))
    b = DenoiseJob(inputs, on_done=lambda j: done.set())
    b_started = {}

    def on_b_step(j):
        b_started.setdefault("a_index_when_b_first_stepped", a.step_index)

    b.on_step = on_b_step
    eng.submit(a)
    while a.step_index < 2:
        time.sleep(0.001)
    eng.submit(b)
    assert done.wait(60)
    eng.shutdown()
    return b_started["a_index_when_b_first_stepped"], a, b


def test_continuous_joins_mid_flight_static_waits(runner, inputs):
    a_idx, a, b = _run_two(runner, inputs, "continuous")
    assert a_idx < a.steps  # B joined while A was still denoising
    a_idx, a, b = _run_two(runner, inputs, "static")
    assert a_idx == a.steps  # B waited for the whole batch to finish


def test_deadline_rejected_at_submit(runner, inputs):
    eng = DenoiseEngine(runner, scheduler=BatchScheduler(model=StepTimeModel(fixed_s=1.0)))
    try:
        with pytest.raises(DeadlineExceeded):
            eng.submit(DenoiseJob(replace(inputs, deadline=time.time() + 0.5)))
    finally:
        eng.shutdown()
