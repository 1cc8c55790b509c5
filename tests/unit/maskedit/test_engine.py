"""The denoise loop: every job ends in a result or an error; cancellation and shutdown are explicit."""

import threading
import time

import numpy as np
import pytest

import torch

from maskedit.denoise import DenoiseJob
from maskedit.engine import DenoiseEngine
from maskedit.errors import Cancelled, ResourceExhausted, Unavailable
from tests.conftest import atol


@pytest.fixture(scope="module")
def inputs(make_inputs):
    return make_inputs(3)


class Outcome:
    """A job's ending: exactly one of on_done / on_error, once (``ends`` counts them)."""

    def __init__(self):
        self.done, self.error, self.event, self.ends = None, None, threading.Event(), 0

    def _end(self, field, value):
        self.ends += 1
        setattr(self, field, value)
        self.event.set()

    def job(self, inputs, **kw):
        return DenoiseJob(inputs, on_done=lambda j: self._end("done", j), on_error=lambda j, e: self._end("error", e),
                          **kw)


def test_batched_jobs_match_single_runs(runner, inputs):
    engine = DenoiseEngine(runner, max_batch=4)
    try:
        outs = [Outcome() for _ in range(3)]
        for o in outs:
            engine.submit(o.job(inputs))
        assert all(o.event.wait(60) for o in outs)
        single = Outcome()
        solo = DenoiseEngine(runner, max_batch=1)
        solo.submit(single.job(inputs))
        assert single.event.wait(60)
        solo.shutdown()
        for o in outs:
            assert o.error is None and o.done.step_index == 3
            np.testing.assert_allclose(o.done.result(), single.done.result(), atol=atol(runner.settings, 1e-5))
            # each carries its steps' wall time, inside its time in the loop, and the loop thread's CPU in them: no
            # more than that wall time where torch runs on this thread alone (its pool threads' CPU is not counted)
            j = o.done
            assert 0 < j.steps_wall_s <= j.finished_at - j.started_at + 1e-6 and j.steps_cpu_s > 0
            if torch.get_num_threads() == 1:
                assert j.steps_cpu_s <= j.steps_wall_s * 1.05 + 1e-3
    finally:
        engine.shutdown()


def test_cancelled_job_ends_with_cancelled(runner, inputs):
    engine = DenoiseEngine(runner)
    try:
        o = Outcome()
        engine.submit(o.job(inputs, is_cancelled=lambda: True))
        assert o.event.wait(30) and isinstance(o.error, Cancelled) and o.done is None
    finally:
        engine.shutdown()


def test_full_queue_is_resource_exhausted_and_shutdown_fails_the_rest(runner, inputs):
    gate = threading.Event()
    engine = DenoiseEngine(runner, max_batch=1, max_queue=2)
    blocker = Outcome()
    # held in its cancel check until the gate opens, after shutdown has failed it; then reported cancelled
    engine.submit(blocker.job(inputs, is_cancelled=lambda: gate.wait(30)))
    for _ in range(500):  # wait until the blocker holds the loop
        if engine.stats()["running"] == 1:
            break
        threading.Event().wait(0.01)
    waiting = [Outcome(), Outcome()]
    for o in waiting:
        engine.submit(o.job(inputs))
    with pytest.raises(ResourceExhausted):
        engine.submit(Outcome().job(inputs))
    engine.shutdown(timeout=0.1)
    gate.set()
    for o in [blocker, *waiting]:
        assert o.event.wait(30)
        assert o.done is not None or isinstance(o.error, Unavailable)
    time.sleep(0.5)  # the loop, back from the blocker's check after shutdown failed it, must not end it again
    assert [o.ends for o in [blocker, *waiting]] == [1, 1, 1]
    assert any(isinstance(o.error, Unavailable) for o in waiting)
    with pytest.raises(Unavailable):
        engine.submit(Outcome().job(inputs))


def test_a_slow_cancel_check_does_not_hold_up_submit(runner, inputs):
    """The loop asks each running request whether it was cancelled without holding the engine's lock: a check that
    stalls (a cancel marker on a slow disk) delays that loop, not the callers submitting or reading stats."""

    gate, asked = threading.Event(), threading.Event()

    def slow():
        asked.set()
        gate.wait(30)
        return False

    engine = DenoiseEngine(runner, max_batch=1, max_queue=4)
    try:
        blocker, other = Outcome(), Outcome()
        engine.submit(blocker.job(inputs, is_cancelled=slow))
        assert asked.wait(30)  # the loop is inside the check
        t0 = time.monotonic()
        engine.submit(other.job(inputs))
        assert engine.stats()["waiting"] + engine.stats()["running"] == 2
        assert time.monotonic() - t0 < 5, "submit waited for the cancel check"
        gate.set()
        assert blocker.event.wait(60) and other.event.wait(60) and blocker.error is None and other.error is None
    finally:
        gate.set()
        engine.shutdown()


def test_a_slow_cancel_check_of_a_request_waiting_for_its_adapters_does_not_hold_up_submit(runner, inputs,
                                                                                          monkeypatch):
    """A request whose adapters are still loading is asked each step whether its client gave up, also outside the
    lock: a check that stalls delays the loop, not submit() and stats(); the request then ends cancelled, alone."""
    gate, asked = threading.Event(), threading.Event()

    def slow():
        asked.set()
        return gate.wait(30)  # the client gave up meanwhile

    engine = DenoiseEngine(runner, max_batch=2, max_queue=4)
    try:
        loading, blocker, other = Outcome(), Outcome(), Outcome()
        waiting = loading.job(inputs, is_cancelled=slow)
        monkeypatch.setattr(runner, "adapters_pending", lambda j: j is waiting)
        engine.submit(waiting)  # unseen by the scheduler: the loop sleeps until there is work
        engine.submit(blocker.job(inputs))
        assert asked.wait(30)  # the loop is inside the check
        t0 = time.monotonic()
        engine.submit(other.job(inputs))
        engine.stats()
        assert time.monotonic() - t0 < 5, "submit waited for the cancel check"
        gate.set()
        assert all(o.event.wait(60) for o in (loading, blocker, other))
        assert isinstance(loading.error, Cancelled) and blocker.error is None and other.error is None
        assert [o.ends for o in (loading, blocker, other)] == [1, 1, 1]
    finally:
        gate.set()
        engine.shutdown()


def _held_prepare(runner, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(gate, inside): the runner's prepare signals ``inside``, then waits for ``gate`` before preparing."""
    gate, inside = threading.Event(), threading.Event()
    prepare = runner.prepare

    def slow(job):
        inside.set()
        gate.wait(30)
        prepare(job)

    monkeypatch.setattr(runner, "prepare", slow)
    return gate, inside


def test_a_slow_prepare_does_not_hold_up_submit_or_stats(runner, inputs, monkeypatch):
    """An admitted request is prepared (tensors to the device, adapters and ControlNets in, the cache's admit, which
    may read the disk tier) without the engine's lock: a prepare that stalls delays the loop, not the callers
    submitting or reading stats; the request counts as running meanwhile, and both end normally."""
    gate, inside = _held_prepare(runner, monkeypatch)
    engine = DenoiseEngine(runner, max_batch=1, max_queue=4)
    try:
        first, other = Outcome(), Outcome()
        engine.submit(first.job(inputs))
        assert inside.wait(30)  # the loop is inside the prepare
        t0 = time.monotonic()
        engine.submit(other.job(inputs))
        stats = engine.stats()
        assert time.monotonic() - t0 < 5, "submit or stats waited for the prepare"
        assert (stats["running"], stats["waiting"]) == (1, 1)
        gate.set()
        assert first.event.wait(60) and other.event.wait(60) and first.error is None and other.error is None
        assert [first.ends, other.ends] == [1, 1]
    finally:
        gate.set()
        engine.shutdown()


def test_shutdown_during_a_slow_prepare_ends_the_request_once(runner, inputs, monkeypatch):
    """Shutdown gives up waiting for the loop while it prepares a request: that request ends UNAVAILABLE at once,
    and when its prepare ends later it is released, never run and never answered twice."""
    gate, inside = _held_prepare(runner, monkeypatch)
    released, release = [], runner.release
    monkeypatch.setattr(runner, "release", lambda job, ok: (released.append((job, ok)), release(job, ok)))
    engine = DenoiseEngine(runner, max_batch=1)
    o = Outcome()
    job = o.job(inputs)
    engine.submit(job)
    assert inside.wait(30)
    engine.shutdown(timeout=0.2)
    assert o.event.wait(5) and isinstance(o.error, Unavailable) and "shut down" in str(o.error)
    gate.set()
    engine._thread.join(30)
    assert not engine._thread.is_alive()
    assert o.ends == 1 and job.step_index == 0
    assert [(j is job, ok) for j, ok in released] == [(True, False)]


def test_bad_job_fails_alone(runner, inputs):
    from dataclasses import replace

    engine = DenoiseEngine(runner, max_batch=2)
    try:
        bad, good = Outcome(), Outcome()
        engine.submit(bad.job(replace(inputs, latents=np.zeros((3, 3), np.float32))))
        engine.submit(good.job(inputs))
        assert bad.event.wait(30) and good.event.wait(30)
        assert bad.error is not None and good.error is None
    finally:
        engine.shutdown()


def test_out_of_memory_in_a_shared_step_fails_only_the_request_at_fault(runner, inputs):
    """A step shared by three requests runs out of device memory because of one of them (simulated: any call
    that includes it raises CUDA's out-of-memory error). The others retry alone and finish exactly; that one ends
    with RESOURCE_EXHAUSTED; the engine keeps serving."""
    from dataclasses import replace

    def oom_with_poisoned(module, args, kwargs):
        g = kwargs.get("guidance")
        if g is not None and bool((g == 99.0).any()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    handle = runner.transformer.register_forward_pre_hook(oom_with_poisoned, with_kwargs=True)
    engine = DenoiseEngine(runner, max_batch=4)
    try:
        outs = [Outcome() for _ in range(3)]
        engine.submit(outs[0].job(inputs))
        engine.submit(outs[1].job(replace(inputs, guidance=99.0)))
        engine.submit(outs[2].job(inputs))
        assert all(o.event.wait(60) for o in outs)
        assert isinstance(outs[1].error, ResourceExhausted) and "out of memory" in str(outs[1].error)
        assert engine.max_running == 3  # they did share steps
        after = Outcome()
        engine.submit(after.job(inputs))
        assert after.event.wait(60) and after.error is None
    finally:
        engine.shutdown()
        handle.remove()
    for o in (outs[0], outs[2], after):
        assert o.error is None and o.done.step_index == 3
        np.testing.assert_allclose(o.done.result(), after.done.result(), atol=atol(runner.settings, 1e-5))


def test_a_lost_device_fails_every_request_clearly_and_refuses_new_ones(runner, inputs):
    """A CUDA error that poisons the context (simulated) cannot be retried: every admitted and waiting request ends
    with UNAVAILABLE saying the server must be restarted, and so does every later submit; nothing hangs."""
    def device_fault(module, args, kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    handle = runner.transformer.register_forward_pre_hook(device_fault, with_kwargs=True)
    engine = DenoiseEngine(runner, max_batch=1)
    try:
        outs = [Outcome() for _ in range(3)]
        for o in outs:
            engine.submit(o.job(inputs))
        assert all(o.event.wait(30) for o in outs)
        assert all(isinstance(o.error, Unavailable) and "must be restarted" in str(o.error) for o in outs)
        with pytest.raises(Unavailable, match="must be restarted"):
            engine.submit(Outcome().job(inputs))
    finally:
        handle.remove()
        engine.shutdown()


def test_a_failing_progress_callback_ends_only_its_request(runner, inputs):
    engine = DenoiseEngine(runner, max_batch=2)
    try:
        bad, good = Outcome(), Outcome()

        def broken_sender(job):
            raise ConnectionError("client went away")

        engine.submit(bad.job(inputs, on_step=broken_sender))
        engine.submit(good.job(inputs, on_step=lambda j: None))
        assert bad.event.wait(30) and good.event.wait(30)
        assert isinstance(bad.error, ConnectionError) and good.error is None and good.done.step_index == 3
    finally:
        engine.shutdown()
