"""The router's health checker: readiness every interval, a real probe request only for a backend that has been
silent for a whole probe interval."""

import time
from types import SimpleNamespace

from maskedit_router.placement.policies import BackendLoad
from maskedit_router.proxy import health
from maskedit_router.proxy.health import HealthChecker


class _Stub:
    def __init__(self, ready=True):
        self.ready = ready

    def ServerReady(self, request, timeout=None):
        return SimpleNamespace(ready=self.ready)


def _backend(last_answer: float, ready=True):
    return SimpleNamespace(addr="b:1", stub=_Stub(ready), load=BackendLoad("b:1"), last_answer=last_answer)


def test_a_backend_answering_traffic_is_not_probed(monkeypatch):
    probes = []
    monkeypatch.setattr(health, "probe", lambda b, timeout_s: probes.append(b.addr) or False)
    checker = HealthChecker(router=None, probe_every_s=5.0)
    assert checker.check(_backend(last_answer=time.monotonic()))  # answered just now: alive, no probe queued
    assert probes == []


def test_a_silent_backend_is_probed_and_a_failed_probe_makes_it_unhealthy(monkeypatch):
    probes = []
    monkeypatch.setattr(health, "probe", lambda b, timeout_s: probes.append(timeout_s) or False)
    checker = HealthChecker(router=None, probe_every_s=5.0, probe_timeout_s=3.0)
    silent = _backend(last_answer=time.monotonic() - 10.0)  # ready, but no answer for longer than the interval
    assert not checker.check(silent)
    assert probes == [3.0]
    assert not checker.check(silent)  # probes at most once per interval, and the verdict holds in between
    assert probes == [3.0]
    checker._last_probe["b:1"] -= 5.0  # next interval: it answered traffic meanwhile, so it is back
    silent.last_answer = time.monotonic()
    assert checker.check(silent) and probes == [3.0]
    assert not checker.check(_backend(last_answer=time.monotonic(), ready=False))  # not ready: no probe needed
    assert probes == [3.0]


def test_a_backend_out_of_rotation_comes_back_only_after_a_probe_request_succeeds(monkeypatch):
    """Readiness and recent answers are not enough once it was found down (a restarted server says ready before
    it can serve): it is probed at every check until a real request succeeds."""
    answers = [False, False, True]
    monkeypatch.setattr(health, "probe", lambda b, timeout_s: answers.pop(0))
    checker = HealthChecker(router=None, probe_every_s=60.0)
    down = _backend(last_answer=time.monotonic())
    down.load.healthy = False  # as the checker's loop leaves it after a failed check
    assert not checker.check(down) and not checker.check(down)  # probed each time, though it answered just now
    assert checker.check(down) and answers == []


def test_the_circuit_breaker_closes_on_a_success_not_after_a_time():
    from maskedit_router.proxy.server import Backend

    b = Backend("127.0.0.1:1", failure_threshold=3)
    try:
        b.failed(), b.failed()
        assert b.available()  # two failures: still in rotation
        b.failed()
        assert b.circuit_open and not b.available()
        b.opened_at -= 3600  # an hour later, still out: no cool-down puts it back unproven
        assert not b.available()
        b.succeeded()
        assert b.available() and not b.circuit_open
        b.trip()  # a definite fault opens it at once
        assert not b.available()
    finally:
        b.close()
