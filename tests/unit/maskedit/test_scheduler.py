"""Admission decisions and the loop's batching behaviour."""

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from maskedit.denoise import DenoiseJob
from maskedit.engine import DenoiseEngine
from maskedit.errors import DeadlineExceeded
from maskedit.scheduler import BatchScheduler, StepTimeModel
from tests.conftest import atol


def fake(tokens=100, steps=4, deadline=None, t=0.0):
    return SimpleNamespace(tokens=tokens, steps=steps, step_index=0, deadline=deadline, submitted_at=t, idle_steps=0)


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


def test_priority_runs_least_remaining_work_first_and_preempts():
    s = BatchScheduler("priority", max_batch=1)
    long_run = fake(tokens=1000, steps=8)  # a template run: every token
    long_run.step_index = 2
    hit = fake(tokens=100, steps=8, t=1)  # a 10 % hit arriving later
    out = s.select([hit], [long_run])
    assert out.admitted == [hit] and out.step == [hit] and out.paused == [long_run] and not out.rejected


def test_priority_serves_urgent_deadlines_before_short_work():
    m = StepTimeModel(fixed_s=0.0, per_token_s=0.001)  # 100 tokens: 0.1 s a step
    s = BatchScheduler("priority", max_batch=1, model=m)
    now = time.time()
    urgent = fake(tokens=500, steps=4, deadline=now + 2.3, t=2)  # 2 s of work, 0.3 s of slack
    short = fake(tokens=100, steps=4, t=1)
    assert s.select([short, urgent], []).step == [urgent]
    relaxed = fake(tokens=500, steps=4, deadline=now + 60, t=2)
    assert s.select([short, relaxed], []).step == [short]  # far from its deadline: size decides


def test_priority_respects_token_budget_batch_size_and_admission_cap():
    s = BatchScheduler("priority", max_batch=3, max_tokens=250, max_active=3)
    running = [fake(100, t=0), fake(100, t=1)]
    out = s.select([fake(100, t=2), fake(40, t=3)], running)
    assert [j.tokens for j in out.step] == [40, 100, 100] and len(out.admitted) == 1
    full = BatchScheduler("priority", max_batch=4, max_active=2)
    out = full.select([fake(10, t=5)], running)
    assert out.admitted == [] and len(out.step) == 2  # no room to prepare another request


def test_priority_never_starves_a_long_request():
    """Short requests keep arriving; the long one still advances at least every ``wait_bound_steps`` steps."""
    s = BatchScheduler("priority", max_batch=2, max_wait_steps=5)
    running, waiting, gaps = [], [], {}
    long_run = fake(tokens=4000, steps=6)
    waiting.append(long_run)
    for step in range(300):
        waiting += [fake(tokens=100, steps=4, t=step + 0.1 * k) for k in range(2)]  # more work than capacity
        out = s.select(waiting, running)
        waiting = [j for j in waiting if j not in out.admitted]
        running += out.admitted
        for j in waiting + out.paused:
            j.idle_steps += 1
        for j in out.step:
            if j in running:
                gaps.setdefault(id(j), []).append(j.idle_steps)
            j.idle_steps = 0
            j.step_index += 1
        running = [j for j in running if j.step_index < j.steps]
        if long_run.step_index >= long_run.steps:
            break
    assert long_run.step_index == long_run.steps
    admitted_gaps = gaps[id(long_run)][1:]  # after its first step: admitted, so the bound applies
    assert max(admitted_gaps) <= s.wait_bound_steps


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


def test_priority_engine_finishes_short_work_first_and_a_preempted_request_is_unchanged(runner, inputs, make_inputs):
    """A long request paused for short ones resumes where it was and ends with the latents it has alone."""
    small = make_inputs(1)
    eng = DenoiseEngine(runner, scheduler=BatchScheduler("priority", max_batch=1))
    order, done = [], threading.Event()
    try:
        long_job = DenoiseJob(replace(inputs, steps=6), on_done=lambda j: (order.append("long"), done.set()))
        eng.submit(long_job)
        while long_job.step_index < 2:
            time.sleep(0.001)
        shorts = [DenoiseJob(replace(small, steps=2), on_done=lambda j: order.append("short")) for _ in range(2)]
        for j in shorts:
            eng.submit(j)
        assert done.wait(120)
    finally:
        eng.shutdown()
    assert order == ["short", "short", "long"]
    solo = DenoiseEngine(runner)
    try:
        from maskedit.local import run_job

        ref = run_job(solo, replace(inputs, steps=6))
    finally:
        solo.shutdown()
    np.testing.assert_allclose(long_job.result(), ref.result(), atol=atol(runner.settings, 1e-5))
