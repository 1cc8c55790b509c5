"""The router after it was itself stopped (SIGSTOP 30 s, a frozen host): the silence and the waits the stall made
are not held against the backends. A resumed router once answered "no healthy backend" while both were in rotation
and refused requests as having waited in front of a check (issue 47)."""

import time
from types import SimpleNamespace

import grpc

from maskedit_router.metrics import RouterMetrics
from maskedit_router.placement.policies import BackendLoad
from maskedit_router.proxy import health
from maskedit_router.proxy.admission import AdmissionGauge
from maskedit_router.proxy.health import HealthChecker
from maskedit_router.proxy.stall import StallDetector

from .test_health import _backend


def test_a_wait_far_longer_than_the_interval_is_a_stall_and_a_late_one_is_not():
    d = StallDetector(interval_s=1.0, threshold_s=3.0)
    assert d.waited(1.1) == 0.0 and d.waited(3.5) == 0.0  # 2.5 s late: a busy host, not a stall
    assert d.waited(31.0) == 30.0
    import threading

    stop = threading.Event()
    stop.set()
    assert d.wait(stop) == (True, 0.0)  # only the wait is timed: the loop's own work (a slow probe) is no stall


def test_after_a_stall_no_backend_is_probed_for_the_silence_it_made(monkeypatch):
    probes = []
    monkeypatch.setattr(health, "probe", lambda b, timeout_s: probes.append(b.addr) or False)
    b = _backend(last_answer=time.monotonic() - 31.0)  # nothing heard for 31 s: the router was stopped for 30
    checker = HealthChecker(SimpleNamespace(backends={"b:1": b}, metrics=RouterMetrics()), probe_every_s=5.0)
    checker.resumed(30.0)
    assert checker.check(b) and probes == []  # a fresh probe interval: the piled-up requests' answers come in it
    assert checker.r.metrics.stalls._value.get() == 1
    checker._last_probe["b:1"] -= 5.0  # an interval later and still silent: now it is probed, and judged
    assert not checker.check(b) and probes == ["b:1"]


def test_a_probe_that_times_out_while_the_backend_answers_others_is_a_busy_backend(monkeypatch):
    b = _backend(last_answer=time.monotonic() - 10.0)

    def slow_probe(backend, timeout_s):  # queued behind a burst: times out, while the burst's answers arrive
        backend.last_answer = time.monotonic()
        return False

    monkeypatch.setattr(health, "probe", slow_probe)
    assert HealthChecker(router=None, probe_every_s=5.0).check(b)


class _SlowReady:
    def ServerReady(self, request, timeout=None):
        raise _Deadline()


class _Deadline(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_slow_readiness_answer_right_after_answers_is_not_a_dead_backend():
    busy = SimpleNamespace(addr="b:1", stub=_SlowReady(), load=BackendLoad("b:1"), last_answer=time.monotonic())
    assert HealthChecker(router=None, probe_every_s=5.0).check(busy)
    silent = SimpleNamespace(addr="c:1", stub=_SlowReady(), load=BackendLoad("c:1"), last_answer=0.0)
    assert not HealthChecker(router=None, probe_every_s=5.0).check(silent)  # a hung backend still leaves


def test_a_resumed_gauge_neither_refuses_nor_expires_on_counts_the_stall_made_stale():
    g = AdmissionGauge(wait_s=0.6)
    g.observe(decided=0, busy_ns=0, now=0.0)
    refused = []
    for i in range(4):
        g.on_sent(f"r{i}", 0.0, lambda i=i: refused.append(i) or True)
    g.backend_refused(0.0)
    g.refused_at = float("inf")  # refusing, whatever the clock says
    now = 30.5  # the router was stopped for 30 s: by its books nothing moved for 30 s
    assert not g.admits(now) and g.expire(now)  # what it would have done (the negative control)
    for e in g.entries.values():
        e.expired = False
    g.resumed()
    assert g.admits(now) and g.expire(now) == []
    g.observe(decided=4, busy_ns=4_000_000, now=now + 0.05)  # the next poll: counting starts again from there
    assert g.waiting() == 0 and g.admits(now + 0.05) and g.expire(now + 1.0) == []


def test_a_check_the_router_was_stopped_inside_gives_no_verdict(monkeypatch):
    """Stopped in the middle of a readiness call: it times out on the stall's clock after SIGCONT. That said nothing
    about the backend, which must stay in rotation."""
    b = _backend(last_answer=0.0)
    b.circuit_open, b.open_circuit = False, lambda: None
    router = SimpleNamespace(backends={"b:1": b}, metrics=RouterMetrics(), backend_down=lambda *a: None)
    checker = HealthChecker(router, probe_timeout_s=0.1)
    monkeypatch.setattr(health, "READY_TIMEOUT_S", 0.1)
    checker.stall.threshold = 0.2

    def stopped_inside(backend):
        time.sleep(0.6)  # (the stall)
        return False

    monkeypatch.setattr(checker, "check", stopped_inside)
    checker.sweep()
    assert b.load.healthy and router.metrics.stalls._value.get() == 1
    monkeypatch.setattr(checker, "check", lambda backend: False)  # a prompt "not ready" is a verdict
    checker.sweep()
    assert not b.load.healthy
