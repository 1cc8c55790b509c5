"""Admission by predicted completion time (``maskedit.completion``): the estimator, the decisions, the board's
backlog and pre-processing's check (``maskedit.admission``), and the denoise loop's checks (``maskedit.scheduler``,
``maskedit.engine``); the wait in front of pre-processing is ``test_arrival.py``'s. No server."""

import math
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from maskedit.admission import FrontCheck, QueueBoard
from maskedit.arrival import ArrivalBound
from maskedit.completion import (CLIENT_BOUND, SERVER_BOUND, Backlog, Bound, Ema, Loop, Work, answer_times,
                                 bound_for, predict, refusal)
from maskedit.denoise import DenoiseJob
from maskedit.engine import DenoiseEngine
from maskedit.errors import DeadlineExceeded, ResourceExhausted
from maskedit.scheduler import HOLD, BatchScheduler, StepTimeModel

CPU = Loop(lambda tokens: 0.001 * tokens, max_batch=4)  # a step costs its batch's tokens: no gain from batching


# -- the estimator ---------------------------------------------------------------------------------------------
def test_one_request_alone_takes_its_steps_then_its_decoding():
    loop = replace(CPU, decode_s=0.5)
    assert answer_times(loop, [], [Work(10, 100)]) == pytest.approx([10 * 0.1 + 0.5])


def test_requests_share_the_batch_and_a_waiting_one_joins_when_a_place_frees():
    loop = replace(CPU, max_batch=2)
    # A has 2 steps left, B 4; C waits. Two steps of A+B (0.2 s each), then B+C for 2 steps, then C alone 2 steps.
    a, b, c = Work(2, 100), Work(4, 100), Work(4, 100)
    assert answer_times(loop, [a, b], [c]) == pytest.approx([0.4, 0.8, 1.0])


def test_batching_pays_where_the_step_time_has_a_fixed_part():
    gpu = Loop(lambda tokens: 0.1 + 0.0001 * tokens, max_batch=4)  # a step of 4 costs little more than a step of 1
    four = answer_times(gpu, [], [Work(10, 100)] * 4)
    assert max(four) == pytest.approx(10 * 0.14)
    assert max(answer_times(CPU, [], [Work(10, 100)] * 4)) == pytest.approx(10 * 0.4)


def test_a_request_still_in_pre_processing_joins_when_it_is_ready():
    # nothing runs: it starts once pre-processed; behind a running request it joins at the next step boundary
    assert answer_times(CPU, [], [Work(5, 100, ready_s=2.0)]) == pytest.approx([2.5])
    times = answer_times(CPU, [Work(10, 100)], [Work(2, 100, ready_s=0.25)])
    assert times[1] == pytest.approx(0.3 + 2 * 0.2)  # joined after the 3rd step (0.3 s), two shared steps


def test_decoding_is_one_at_a_time_in_finishing_order():
    loop = replace(CPU, decode_s=1.0)
    assert sorted(answer_times(loop, [Work(1, 100), Work(1, 100)], [])) == pytest.approx([1.2, 2.2])


def test_the_token_budget_keeps_the_next_request_waiting():
    loop = replace(CPU, max_tokens=150)
    assert answer_times(loop, [Work(2, 100)], [Work(2, 100)]) == pytest.approx([0.2, 0.4])


# -- the decisions ---------------------------------------------------------------------------------------------
def test_admitted_while_in_time_refused_with_when_to_retry_once_the_work_ahead_makes_it_late():
    bound = Bound(10.0, 0.0, SERVER_BOUND)
    ahead = [Work(30, 100)] * 4  # 4 in the batch: 30 steps of 0.4 s = 12 s
    assert refusal(CPU, [], [], Work(30, 100, 10.0), bound) is None  # 3 s alone
    err = refusal(CPU, ahead, [], Work(30, 100, 10.0), bound)
    assert isinstance(err, ResourceExhausted)
    text = str(err)
    assert "within 10 s of its arrival" in text and SERVER_BOUND in text and "4 requests ahead" in text, text
    assert "refused before any work" in text and "retry in ~" in text, text
    p = predict(CPU, ahead, [], Work(30, 100, 10.0))
    assert text.endswith(f"retry in ~{math.ceil(p.answer_s - 10.0)} s or send it to another server"), text


def test_a_deadline_missed_with_nothing_ahead_is_deadline_exceeded_naming_deadline_ms():
    err = refusal(CPU, [], [], Work(30, 100, 1.0), Bound(1.0, 0.0, CLIENT_BOUND))  # 3 s of work, 1 s deadline
    assert isinstance(err, DeadlineExceeded) and str(err).startswith("DEADLINE_MS: ") and "1000 ms" in str(err)
    # its deadline missed only because of the work ahead: a refusal to retry, not a hopeless request
    err = refusal(CPU, [Work(30, 100)] * 4, [], Work(5, 100, 1.0), Bound(1.0, 0.0, CLIENT_BOUND))
    assert isinstance(err, ResourceExhausted) and "its DEADLINE_MS" in str(err)
    # the server's bound missed with nothing ahead: the host is too slow now; retry (not a bad request)
    err = refusal(CPU, [], [], Work(30, 100, 1.0), Bound(1.0, 0.0, SERVER_BOUND))
    assert isinstance(err, ResourceExhausted) and "nothing ahead of it" in str(err)


def test_the_wait_already_spent_counts_against_the_bound():
    new = Work(30, 100, answer_by=10.0 - 8.0)  # 3 s of work; 8 s of its 10 spent in the queue
    err = refusal(CPU, [], [], new, Bound(10.0, 8.0, SERVER_BOUND))
    assert isinstance(err, ResourceExhausted) and "8.0 s of them spent waiting" in str(err), str(err)


def test_a_newcomer_that_would_make_a_request_already_taken_late_is_refused():
    # A is in time alone (2 steps left, 0.2 s; bound 0.3 s); B sharing its steps would make it 0.4 s
    a = Work(2, 100, answer_by=0.3)
    p = predict(CPU, [a], [], Work(2, 100, answer_by=100.0))
    assert p.delays == (0,) and p.answer_s <= 100
    err = refusal(CPU, [a], [], Work(2, 100, answer_by=100.0), Bound(100.0, 0.0, SERVER_BOUND))
    assert isinstance(err, ResourceExhausted) and "would delay 1 requests already taken" in str(err)
    # A late without it anyway: it changes nothing for A
    late_anyway = Work(2, 100, answer_by=0.1)
    assert refusal(CPU, [late_anyway], [], Work(2, 100, answer_by=100.0), Bound(100.0, 0.0, SERVER_BOUND)) is None


def test_bound_is_the_tighter_of_the_servers_and_the_requests():
    assert bound_for(10.0, None, 0.5) == Bound(10.0, 0.5, SERVER_BOUND)
    assert bound_for(10.0, 2000, 0.0) == Bound(2.0, 0.0, CLIENT_BOUND)
    assert bound_for(10.0, 20000, 0.0).source == SERVER_BOUND
    assert bound_for(0.0, 2000, 0.0).source == CLIENT_BOUND
    assert bound_for(0.0, None, 0.0) is None
    assert Bound(10.0, 3.0, SERVER_BOUND).left == 7.0


def test_the_step_time_measured_on_a_slower_host_changes_the_decision():
    """The estimate is the loop's measured step time, not a calibration: the same backlog is admitted on a quiet
    host and refused once its steps are measured 5x slower (a loaded host)."""
    m = StepTimeModel(fixed_s=0.0, per_token_s=0.0005)
    for _ in range(30):
        m.observe(400, 0.2)  # quiet: 0.5 ms per token
    loop = lambda: Loop(m.predict, max_batch=4)  # noqa: E731
    ahead, new, bound = [Work(20, 100)] * 3, Work(20, 100, 10.0), Bound(10.0, 0.0, SERVER_BOUND)
    assert refusal(loop(), ahead, [], new, bound) is None  # 20 steps of 0.2 s
    for _ in range(30):
        m.observe(400, 1.0)  # loaded: the same steps take 5x as long
    assert isinstance(refusal(loop(), ahead, [], new, bound), ResourceExhausted)  # 20 steps of 1 s


def test_one_outlier_step_moves_the_measured_step_time_for_a_few_steps_only():
    m = StepTimeModel(fixed_s=0.0, per_token_s=0.001)
    m.observe(100, 10.0)  # the process was stopped for 10 s mid-step
    assert m.predict(100) == pytest.approx(0.1 * (1 + 0.2 * 19))  # not 0.1 + 0.2 * 9.9
    for _ in range(10):
        m.observe(100, 0.1)  # back to 1 ms per token within a few steps
    assert m.predict(100) < 0.15
    e = Ema(value=1.0)
    e.observe(100.0)
    assert e.get() == pytest.approx(4.8)
    e.observe(float("nan"))
    assert e.get() == pytest.approx(4.8) and Ema().get(7.0) == 7.0


def test_frequent_slow_steps_count_in_full():
    """A loaded host: one step in four takes 40 times the others. The mean step time is what a request's completion
    takes; the estimate follows it (a clamp at a few times the estimate would keep it near the fast steps')."""
    m = StepTimeModel(fixed_s=0.0, per_token_s=0.0001)
    seen = []
    for i in range(400):
        m.observe(100, 0.4 if i % 4 == 3 else 0.01)
        seen.append(m.predict(100))
    mean = (3 * 0.01 + 0.4) / 4
    assert sum(seen[-100:]) / 100 == pytest.approx(mean, rel=0.25)


def test_a_step_time_that_barely_depends_on_tokens_is_not_charged_to_them():
    """The tiny CPU model: a step of 24 tokens takes what one of 256 takes (its fixed part dominates). Measured at
    24 tokens, the estimate for 256 stays near it (charging it all per token predicted 10x); and where the time is
    linear in the tokens (a GPU's large batches), both parts are found."""
    m = StepTimeModel()  # the default split: 10 ms + 0.2 ms per token
    for i in range(40):
        m.observe(256 if i < 20 else 24, 0.1)
    assert m.predict(24) == pytest.approx(0.1, rel=0.05) and m.predict(256) < 0.15
    m = StepTimeModel()
    for i in range(300):
        tokens = (100, 200, 400, 800)[i % 4]
        m.observe(tokens, 0.002 + 1e-5 * tokens)
    assert (m.fixed_s, m.per_token_s) == (pytest.approx(0.002, rel=0.05), pytest.approx(1e-5, rel=0.05))


# -- the board and pre-processing's check ------------------------------------------------------------------
def test_the_backlog_crosses_processes_and_what_does_not_fit_is_lumped(tmp_path):
    denoise, pre = QueueBoard(tmp_path / "b"), QueueBoard(tmp_path / "b")
    assert pre.backlog() is None
    denoise.publish_backlog(Backlog([(3, 100, 50.0)], [(8, 200, math.inf)], 0.01, 0.002, 150.0))
    b = pre.backlog()
    assert b.running == [(3, 100, 50.0)] and b.waiting == [(8, 200, math.inf)]
    assert (b.fixed_s, b.per_token_s, b.tokens) == (0.01, 0.002, 150.0) and b.step_s(100) == pytest.approx(0.21)
    from maskedit.admission import JOBS

    denoise.publish_backlog(Backlog([], [(i % 7 + 1, 10, 1.0) for i in range(JOBS + 50)], 0.0, 0.001, 10.0))
    b = pre.backlog()
    assert len(b.waiting) == JOBS and b.waiting[-1] == (7, 10 * 51, math.inf)
    denoise.decoded(0.25)
    assert pre.decode_s() == 0.25


def test_a_write_under_way_is_never_read(tmp_path):
    import struct

    from maskedit.admission import _SEQ

    board = QueueBoard(tmp_path / "b")
    board.publish_backlog(Backlog([(1, 1, 1.0)], [], 0.0, 0.0, 0.0))
    struct.pack_into("<q", board._map, _SEQ, 3)  # a writer stopped mid-write
    assert board.backlog(tries=3) is None


def _front(tmp_path, bound_s=10.0):
    denoise, pre = QueueBoard(tmp_path / "b"), QueueBoard(tmp_path / "b")
    return denoise, pre, FrontCheck(pre, bound_s, max_batch=4, max_tokens=1 << 30, full_tokens=256)


def test_pre_processing_refuses_before_any_work_what_the_published_backlog_would_make_late(tmp_path):
    denoise, pre, front = _front(tmp_path)
    now = time.time()
    a = front.admit(now, 30, None)  # nothing published yet: admitted
    assert (a.bound.seconds, a.bound.source) == (10.0, SERVER_BOUND) and a.arrival.at <= now and a.predicted_at >= now
    denoise.publish_backlog(Backlog([(30, 256, math.inf)] * 4, [], 0.0, 0.001, 256.0))  # 30 steps of ~1 s ahead
    with pytest.raises(ResourceExhausted, match="cannot be answered within 10 s"):
        front.admit(time.time(), 30, None)
    with pytest.raises(ResourceExhausted):
        front.admit(time.time(), 30, 3_600_000)  # a longer DEADLINE_MS does not loosen the server's bound
    denoise.publish_backlog(Backlog([], [], 0.0, 0.001, 256.0))  # drained: 30 steps of 0.26 s alone
    assert front.admit(time.time(), 30, None).bound is not None
    _, _, off = _front(tmp_path / "off", bound_s=0.0)
    assert off.admit(time.time(), 30, None).bound is None  # no bound, no DEADLINE_MS: no time check


def test_requests_sent_on_but_not_arrived_count_as_work_ahead(tmp_path):
    denoise, pre, front = _front(tmp_path)
    denoise.publish_backlog(Backlog([], [], 0.0, 0.0002, 256.0))  # ~0.05 s a step alone, 0.2 s a batch of 4
    by = time.time() + 60
    for _ in range(8):  # pre-processed and on their way, not in the published queue yet
        front.sent(30, 256, by)
        pre.passed()
    with pytest.raises(ResourceExhausted, match="8 requests ahead"):
        front.admit(time.time(), 30, None)  # two batches of 4 (6 s each) ahead of its own 1.5 s
    for _ in range(8):
        denoise.arrived()  # they arrived (and, say, were refused there): nothing on the way
    front.admit(time.time(), 30, None)


def test_the_wait_in_front_of_pre_processing_counts(tmp_path):
    denoise, pre, front = _front(tmp_path)
    denoise.publish_backlog(Backlog([], [], 0.0, 0.0002, 256.0))  # 30 steps: ~1.5 s alone
    t = time.time()
    with pytest.raises(ResourceExhausted, match="9.0 s of them spent waiting"):
        front.admit(t, 30, None, floor=t - 9)  # intake saw it 9 s ago (maskedit.intake)
    assert front.admit(t, 30, None, floor=t - 0.1).arrival.at == t - 0.1
    # a direct call (no intake): inferred from pre-processing's own executions, busy back to back for the last 9 s
    front.arrivals = ArrivalBound(now=t - 10)
    d = 9 / 19
    for i in range(19):
        front.ran(t - 9 + i * d, t - 9 + (i + 1) * d, prepared=False)
    with pytest.raises(ResourceExhausted, match="spent waiting"):
        front.admit(t, 30, None)


# -- the denoise loop's checks ------------------------------------------------------------------------------
def _job(tokens=100, steps=4, answer_by=None, bound_s=10.0, source=SERVER_BOUND, t=0.0):
    inputs = SimpleNamespace(answer_by=answer_by, bound_s=bound_s, bound_source=source)
    return SimpleNamespace(tokens=tokens, steps=steps, step_index=0, deadline=None, submitted_at=t, idle_steps=0,
                           inputs=inputs, fair_tag=0.0)


def test_a_request_that_waited_too_long_is_refused_at_the_front_of_the_queue_not_served_late():
    s = BatchScheduler("continuous", max_batch=2, model=StepTimeModel(fixed_s=0.0, per_token_s=0.001))
    now = time.time()
    waited = _job(answer_by=now + 0.3)  # 4 steps of 0.1 s: 0.4 s, 0.3 s of its bound left
    fresh = _job(answer_by=now + 10, t=1.0)
    chosen, rejected = s.admit([waited, fresh], [])
    assert chosen == [fresh] and rejected[0][0] is waited and isinstance(rejected[0][1], ResourceExhausted)
    text = str(rejected[0][1])
    assert "since its arrival and can no longer be answered within 10 s" in text and SERVER_BOUND in text, text
    own = _job(answer_by=now + 0.3, bound_s=1.0, source=CLIENT_BOUND)  # its own DEADLINE_MS: DEADLINE_EXCEEDED
    _, rejected = s.admit([own], [])
    assert isinstance(rejected[0][1], DeadlineExceeded) and "DEADLINE_MS" in str(rejected[0][1])


def test_one_that_would_make_a_running_request_late_waits_for_a_later_step():
    s = BatchScheduler("continuous", max_batch=2, model=StepTimeModel(fixed_s=0.0, per_token_s=0.001))
    now = time.time()
    running = _job(steps=2, answer_by=now + 0.3)  # 0.2 s alone, 0.4 s with another beside it
    newcomer = _job(answer_by=now + 100, t=1.0)
    assert s.joins(newcomer, [running], now) is HOLD
    assert s.admit([newcomer], [running]) == ([], [])  # held, not refused
    running.step_index = 2  # it finished: the newcomer joins
    assert s.admit([newcomer], []) == ([newcomer], [])


def test_no_bound_changes_nothing():
    s = BatchScheduler("continuous", max_batch=2)
    jobs = [_job(answer_by=None, t=i) for i in range(3)]
    assert s.admit(jobs, []) == (jobs[:2], [])


def test_the_engine_refuses_at_submit_what_its_batch_and_queue_would_make_late(runner, make_inputs):
    one_s_a_step = StepTimeModel(fixed_s=1.0, per_token_s=0.0, alpha=0.0, slope_alpha=0.0)  # learns nothing: 1 s
    eng = DenoiseEngine(runner, scheduler=BatchScheduler(max_batch=1, model=one_s_a_step))
    published = []
    eng.on_backlog = published.append
    bounded = lambda inputs, s: replace(inputs, answer_by=time.time() + s, bound_s=s,  # noqa: E731
                                        bound_source=SERVER_BOUND)
    long_run, short = make_inputs(100), make_inputs(4)
    try:
        eng.submit(DenoiseJob(long_run))  # 100 steps ahead (predicted 100 s), no bound of its own
        with pytest.raises(ResourceExhausted, match="refused before denoising"):
            eng.submit(DenoiseJob(bounded(short, 6.0)))  # alone 4 s: in time; behind it, not
        eng.submit(DenoiseJob(bounded(short, 600.0)))
        assert published[-1].fixed_s == 1.0 and len(published[-1].running) + len(published[-1].waiting) == 2
    finally:
        eng.shutdown()


def test_a_request_being_prepared_counts_as_work_ahead(runner, make_inputs, monkeypatch):
    """An admitted request is prepared outside the engine's lock: a submit meanwhile still counts it ahead (and
    the backlog pre-processing reads shows it running), as it would once it runs."""
    one_s_a_step = StepTimeModel(fixed_s=1.0, per_token_s=0.0, alpha=0.0, slope_alpha=0.0)
    eng = DenoiseEngine(runner, scheduler=BatchScheduler(max_batch=1, model=one_s_a_step))
    published = []
    eng.on_backlog = published.append
    gate, inside, prepare = threading.Event(), threading.Event(), runner.prepare
    monkeypatch.setattr(runner, "prepare", lambda job: (inside.set(), gate.wait(30), prepare(job)))
    try:
        eng.submit(DenoiseJob(make_inputs(100)))  # 100 steps (predicted 100 s), held in its prepare
        assert inside.wait(30)
        assert len(published[-1].running) == 1 and not published[-1].waiting
        with pytest.raises(ResourceExhausted, match="refused before denoising"):
            eng.submit(DenoiseJob(replace(make_inputs(4), answer_by=time.time() + 6.0, bound_s=6.0,
                                          bound_source=SERVER_BOUND)))
    finally:
        gate.set()
        eng.shutdown(timeout=0)
        eng._thread.join(30)


def test_an_admitted_request_that_can_no_longer_be_answered_in_time_ends_before_its_next_step(runner, make_inputs):
    """The host turned slower than predicted: a request past its bound is ended with DEADLINE_EXCEEDED (an answer
    within the bound, its place freed) instead of answered late; one without a bound runs on."""
    eng = DenoiseEngine(runner, scheduler=BatchScheduler(max_batch=4))
    ended, done = {}, threading.Event()
    free, inputs = DenoiseJob(make_inputs(100)), make_inputs(100)
    try:
        eng.scheduler.model = StepTimeModel(fixed_s=0.001, per_token_s=0.0)  # predicted 0.1 s: admitted
        eng.submit(free)
        bounded = DenoiseJob(replace(inputs, answer_by=time.time() + 0.2, bound_s=0.2, bound_source=SERVER_BOUND),
                             on_error=lambda j, e: (ended.setdefault("e", e), done.set()))
        eng.submit(bounded)  # its 100 steps take longer than predicted (beside the other one, on this host)
        assert done.wait(60), "never ended"
        e = ended["e"]
        assert isinstance(e, DeadlineExceeded) and "ran out of its bound of 0.2 s" in str(e), e
        assert SERVER_BOUND in str(e) and bounded.step_index < bounded.steps
        assert time.time() < bounded.inputs.answer_by + 5
    finally:
        eng.shutdown()
    assert free.done


def test_requests_finishing_at_the_same_step_count_the_decodings_ahead_of_them(runner, make_inputs):
    """Two requests at their last step are decoded one after the other: with 1.5 s left and a decoding measured at
    1 s, the first is answered in time and goes on; the second would be answered after 2 s and ends now (a decoding
    counted once for each let it through, answered late)."""
    frozen = StepTimeModel(fixed_s=0.0, per_token_s=0.0, alpha=0.0, slope_alpha=0.0)
    eng = DenoiseEngine(runner, scheduler=BatchScheduler(max_batch=4, model=frozen, decode_s=lambda: 1.0))
    ended = {}
    try:
        inputs = make_inputs(4)
        now = time.time()
        jobs = []
        for i in range(2):
            j = DenoiseJob(replace(inputs, answer_by=now + 1.5, bound_s=1.5, bound_source=SERVER_BOUND),
                           on_error=lambda j, e, i=i: ended.setdefault(i, e))
            j.step_index = j.steps - 1
            jobs.append(j)
        with eng._cv:
            eng._running.extend(jobs)
        kept = eng._drop_overdue(list(jobs))
        assert kept == jobs[:1] and list(ended) == [1] and "ran out of its bound" in str(ended[1])
    finally:
        eng.shutdown()
