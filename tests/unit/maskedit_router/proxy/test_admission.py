"""Admission in the router (``maskedit_router/proxy/admission.py``): an edit goes only to a backend that would reach its
admission check within the admission wait; when none would, it is refused at once with RESOURCE_EXHAUSTED on its own
stream. No server: the backends' statistics are fed in by hand."""

import time
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from maskedit.cache.cost_model import CostModel
from maskedit_client import EditClient, EditError
from maskedit_router.placement.features import EditFeatures
from maskedit_router.placement.policies import Estimator, make
from maskedit_router.proxy import admission, backend_streams, server, stream_session
from maskedit_router.proxy.admission import AdmissionGauge, AdmissionWatcher

EDIT = EditFeatures("t", 0.2, 256, 8)
MS = 1_000_000  # nanoseconds


def _gauge(refusing: bool = True, **kw) -> AdmissionGauge:
    """A gauge that has seen its backend's counts, and (``refusing``) a backend that refuses requests."""
    g = AdmissionGauge(**kw)
    g.observe(decided=0, busy_ns=0, now=0.0)
    if refusing:
        g.refused_at = float("inf")  # it refuses, whatever the test's clock says
    return g


def _send(g: AdmissionGauge, n: int, now: float = 0.0, refused=None) -> list[str]:
    keys = [f"r{g.sent + i}" for i in range(n)]
    for k in keys:
        g.on_sent(k, now, (lambda k=k: refused.append(k) or True) if refused is not None else None)
    return keys


# -- the gauge: where to send ------------------------------------------------------------------------
def test_a_backend_never_observed_is_admitted_as_before():
    g = AdmissionGauge()
    _send(g, 50)
    assert g.waiting() == 0 and g.admits(0.0) and g.expire(100.0) == []


def test_waiting_is_what_was_sent_less_what_the_check_finished():
    g = _gauge()
    _send(g, 5)
    assert g.waiting() == 5
    g.observe(decided=3, busy_ns=3 * 100 * MS, now=0.3)
    assert g.waiting() == 2 and g.per_request_s == pytest.approx(0.1)
    assert g.predicted_wait_s() == pytest.approx(0.2)


def test_the_admission_wait_bounds_the_predicted_wait_not_the_number_waiting():
    g = _gauge(wait_s=0.5)
    g.per_request_s = 0.1
    _send(g, 5)  # 5 x 0.1 s = 0.5 s: still within
    assert g.admits(0.0)
    _send(g, 1)
    assert not g.admits(0.0)  # 0.6 s
    g.per_request_s = 0.004  # cheap refusals: the same 6 waiting take 24 ms
    assert g.admits(0.0)


def test_two_may_always_wait_so_pre_processing_never_idles_for_want_of_work():
    g = _gauge(wait_s=0.5)
    g.per_request_s = 2.0  # a slow check: one waiting is already past the admission wait
    _send(g, 1)
    assert g.admits(0.0)  # one in the check, one more may queue behind it
    _send(g, 1)
    assert not g.admits(0.0)


def test_until_the_check_s_cost_is_measured_the_backstop_alone_bounds_the_wait():
    g = _gauge()
    _send(g, 5)
    assert g.admits(0.0)  # not refused at once on a guess (a burst at start-up on an idle system is served)
    g.observe(decided=1, busy_ns=200 * MS, now=0.1)
    assert not g.admits(0.1)  # 4 x 0.2 s


def test_a_backend_that_admits_everything_is_left_alone_however_long_its_queue():
    g = _gauge(refusing=False, wait_s=0.6)
    g.per_request_s = 0.5
    _send(g, 6, refused=[])
    assert g.admits(10.0) and g.expire(10.0) == []  # what waits there will be served, not refused
    g.backend_refused(10.0)  # it refused one (its denoise queue is full): now what waits may be refused there too
    assert not g.admits(10.0) and len(g.expire(10.0)) == 5
    assert g.refusing(15.0) and not g.refusing(15.1)  # 5 s after its last refusal it counts as admitting again


def test_a_backend_holding_as_much_as_when_it_last_refused_counts_as_refusing_before_it_says_so():
    """The onset of the next burst: what it held at its last refusal of its own is what it can hold."""
    g = _gauge(refusing=False, wait_s=0.6)
    g.per_request_s = 0.5
    _send(g, 4)
    g.observe(decided=3, busy_ns=3 * 500 * MS, now=1.0)  # three past the check, one waiting
    g.backend_refused(1.0)
    assert g.full_at == 3
    for key in list(g.entries)[:3]:
        g.ended(key, answered=True, now=2.0)  # served: it holds fewer now
    assert not g.refusing(20.0)  # 19 s after its refusal, holding 0 of 3
    _send(g, 5, now=20.0)
    g.observe(decided=6, busy_ns=6 * 500 * MS, now=20.5)  # three more past its check: as full as it was
    assert g.past_check() == 3 and g.refusing(20.5) and not g.admits(20.5)
    assert not g.refusing(61.5)  # what it learnt is forgotten a minute after its refusal


def test_refusing_lasts_while_the_router_refuses_on_the_backends_behalf():
    """In sustained overload the router's refusals keep the backend from refusing itself: they must keep it
    refusing too, or the queue in front of its check grows back and its refusals come late."""
    g = _gauge(refusing=False)
    g.backend_refused(10.0)
    g.refused_for(14.0)
    assert g.refusing(18.5) and not g.refusing(19.1)
    g.refused_for(12.0)  # an older refusal does not shorten it
    assert g.refusing(18.5)


def test_a_check_that_makes_no_progress_closes_the_backend_until_it_does():
    g = _gauge(wait_s=0.5)
    g.per_request_s = 0.01
    _send(g, 1, now=10.0)  # nothing waited before: the wait starts now, not at the last statistics
    assert g.admits(10.4) and g.stalled_s(10.4) == pytest.approx(0.4)
    g.observe(decided=0, busy_ns=0, now=10.6)  # statistics arrive, the check has not moved
    assert not g.admits(10.6)  # stalled for 0.6 s: the per-request cost measured before no longer holds
    g.observe(decided=1, busy_ns=10 * MS, now=10.7)
    assert g.waiting() == 0 and g.admits(10.7)


def test_requests_the_router_did_not_send_do_not_make_waiting_negative():
    g = _gauge()
    _send(g, 1)
    g.observe(decided=4, busy_ns=4 * MS, now=0.1)  # a health probe and two other clients' requests
    assert g.waiting() == 0
    _send(g, 1, now=0.2)
    assert g.waiting() == 1  # the next send counts at once, not after the surplus is used up


def test_edits_the_router_let_go_of_leave_the_count_and_a_restart_starts_again():
    g = _gauge()
    keys = _send(g, 10)
    for k in keys[:6]:
        g.ended(k, answered=False)  # six of them ended on the router's side (e.g. failed over elsewhere)
    assert g.waiting() == 4
    g.observe(decided=2, busy_ns=0, now=0.1)  # (maybe those six's decisions: taken as the oldest four's)
    assert g.waiting() == 2
    g.observe(decided=0, busy_ns=0, now=0.2)  # the backend restarted: its counters start at 0
    assert g.waiting() == 0
    _send(g, 1, now=0.3)
    assert g.waiting() == 1
    g.observe(decided=1, busy_ns=MS, now=0.4)
    assert g.waiting() == 0 and g.admits(0.4)


def test_an_answer_before_the_next_poll_never_puts_an_admitted_edit_back_in_front_of_the_check():
    """The race a count-only gauge lost: younger edits refused at the check are answered before the poll counts
    them; the older, admitted ones (still in flight, in the denoise loop) must stay past the check."""
    g = _gauge(wait_s=0.6)
    refused = []
    a, b, c, d = _send(g, 4, now=0.0, refused=refused)
    g.observe(decided=2, busy_ns=2 * MS, now=0.1)  # a and b admitted (in flight for seconds)
    g.ended(d, answered=True, now=0.2)  # d refused at the check: so c is past it too (first come, first served)
    assert g.waiting() == 0 and g.expire(5.0) == [] and refused == []
    g.observe(decided=4, busy_ns=4 * MS, now=0.25)  # the poll now counts c and d: already known, nothing more
    e, = _send(g, 1, now=0.3, refused=refused)
    assert g.waiting() == 1 and g.expire(5.0) == []  # e is the oldest in front of the check (maybe in it)
    assert [x for x in g.entries if not g.entries[x].decided] == [e]


def test_a_decision_the_count_never_shows_is_forgotten():
    g = _gauge(early_ttl_s=2.0)
    x, = _send(g, 1, now=0.0)
    g.ended(x, answered=True, now=0.0)  # rejected by Triton before pre-processing: never counted
    y, z = _send(g, 2, now=3.0)
    g.observe(decided=1, busy_ns=MS, now=3.1)  # y's decision, not x's (that one is 3 s old)
    assert [k for k in g.entries if not g.entries[k].decided] == [z]


def test_an_admission_wait_of_zero_turns_admission_in_the_router_off():
    g = _gauge(wait_s=0.0)
    g.per_request_s = 1.0
    _send(g, 20)
    assert g.admits(100.0)


# -- the gauge: the backstop ------------------------------------------------------------------------
def test_edits_behind_the_one_in_the_check_expire_after_the_timeout():
    g = _gauge(wait_s=0.6)
    refused = []
    keys = _send(g, 4, now=0.0, refused=refused)
    g.observe(decided=1, busy_ns=MS, now=0.5)  # r0 passed the check; r1 may be in it; r2, r3 wait behind
    assert g.expire(0.5) == []  # not yet 0.6 s
    due = g.expire(0.6)
    assert [k for k, _ in due] == keys[2:]  # never the oldest undecided: it may be in the check (admitted)
    assert all(refuse() for _, refuse in due) and refused == keys[2:]
    assert g.expire(0.7) == []  # once
    assert g.predicted_wait_s() == pytest.approx(g.per_request_s)  # refused ones cost the check nothing


def test_an_edit_the_router_refused_counts_until_the_backend_answers_it():
    g = _gauge(wait_s=0.6)
    keys = _send(g, 3, refused=[])
    assert [k for k, _ in g.expire(1.0)] == keys[1:]
    for k in keys[1:]:
        g.ended(k, answered=False)  # the router released it when it refused it ...
    assert g.waiting() == 3  # ... but it is still in the backend's queue
    g.ended(keys[1], answered=True)  # the backend answered it (cancelled, before any work)
    g.observe(decided=2, busy_ns=MS, now=1.1)  # r0 (admitted, still in flight) and r1
    assert g.waiting() == 1 and list(g.entries) == [keys[0], keys[2]]


def test_edits_that_passed_the_check_never_expire():
    g = _gauge(wait_s=0.6)
    keys = _send(g, 3, refused=[])
    g.observe(decided=3, busy_ns=3 * MS, now=0.1)  # all three admitted, now in the denoise loop for a while
    assert g.expire(5.0) == [] and list(g.entries) == keys


def test_a_refusal_that_came_too_late_is_taken_back():
    g = _gauge(wait_s=0.6)
    keys = _send(g, 3)
    g.entries[keys[2]].on_expire = lambda: False  # it streamed meanwhile
    (key, refuse), = [d for d in g.expire(1.0) if d[0] == keys[2]]
    assert not refuse()
    g.unexpire(key)
    assert not g.entries[key].expired


def test_a_restart_forgets_the_edits_the_router_refused_there():
    g = _gauge(wait_s=0.6)
    keys = _send(g, 3, refused=[])
    g.expire(1.0)
    g.observe(decided=0, busy_ns=0, now=1.1)  # same count: no restart yet
    g.observe(decided=5, busy_ns=0, now=1.2)
    g.observe(decided=0, busy_ns=0, now=1.3)  # restarted: it will never answer the refused ones
    assert list(g.entries) == keys[:1]


def test_counts_read_the_preprocess_model_from_model_statistics():
    resp = service_pb2.ModelStatisticsResponse()
    m = resp.model_stats.add(name="preprocess", version="1")
    m.inference_stats.success.count, m.inference_stats.fail.count = 7, 1
    m.inference_stats.compute_input.ns, m.inference_stats.compute_infer.ns = 5, 90
    m.inference_stats.compute_output.ns = 5
    resp.model_stats.add(name="masked_denoise", version="1").inference_stats.success.count = 99
    assert admission.counts(resp) == (8, 100)
    assert admission.counts(resp, "vae_decode") is None


# -- the router -----------------------------------------------------------------------------------
@pytest.fixture
def router():
    est = Estimator(CostModel.fallback())
    r = server.Router(["a:1", "b:2"], make("least_requests", est), est, admission_wait_s=0.5)
    for b in r.backends.values():
        r.observe_admission(b, 0, 0)
        b.admission.per_request_s = 0.1
        b.admission.refused_at = float("inf")  # both refuse requests (their denoise queues are full)
    yield r
    for b in r.backends.values():
        b.close()


def _fill(router, addr: str, n: int) -> None:
    """``n`` edits routed to ``addr`` that its check has not reached."""
    b = router.backends[addr]
    for _ in range(n):
        b.load.inflight += 1
        b.admission.on_sent(f"{addr}-{b.admission.sent}", b.admission.moved_at)


def test_edits_go_to_a_backend_that_can_admit_them_while_the_other_is_full(router):
    _fill(router, "a:1", 6)  # 0.6 s in front of a's check
    assert {router.route(EDIT).backend.addr for _ in range(3)} == {"b:2"}


def test_an_edit_is_refused_at_once_when_no_backend_can_admit_it(router):
    _fill(router, "a:1", 6)
    _fill(router, "b:2", 6)
    with pytest.raises(server.NoBackend) as e:
        router.route(EDIT)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "a:1 has 6 waiting" in str(e.value) and "b:2 has 6 waiting" in str(e.value)
    assert router.metrics.refusals.labels("admission")._value.get() == 1
    assert router.route(EditFeatures(None, 0.0, 0, None)).backend  # a call that runs no edit is not gated
    router.observe_admission(router.backends["b:2"], 3, 3 * 100 * MS)  # b's check moved on: room again
    assert router.route(EDIT).backend.addr == "b:2"


def test_a_refusal_in_the_router_keeps_the_backends_refusing(router):
    t0 = time.monotonic()
    for b in router.backends.values():
        b.admission.refused_at = t0 - 4.0  # their last refusal of their own, 4 s ago
    _fill(router, "a:1", 6)
    _fill(router, "b:2", 6)
    with pytest.raises(server.NoBackend):
        router.route(EDIT)
    assert all(b.admission.refused_at >= t0 for b in router.backends.values())


def _session(router, monkeypatch):
    sent = []

    class _Stream:
        def __init__(self, session, backend):
            self.backend, self.broken = backend, False

        def send(self, req):
            sent.append((self.backend.addr, req.id))

        def cancel(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(backend_streams, "_BackendStream", _Stream)
    monkeypatch.setattr(stream_session, "routing_features", lambda req, resolution: EDIT)
    ctx = SimpleNamespace(add_callback=lambda cb: None, is_active=lambda: True)
    return stream_session._StreamSession(router, ctx), sent


def test_a_refusal_in_the_router_reaches_its_own_caller_with_several_pending(router, monkeypatch):
    """EditClient matches an error to its request by the id in its text (tritonclient drops the id field)."""
    session, sent = _session(router, monkeypatch)
    for b in router.backends.values():
        b.admission.per_request_s = 0.12  # a 0.5 s admission wait: up to 4 waiting
    _fill(router, "a:1", 6)
    _fill(router, "b:2", 4)
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="c-0"))  # b has room for one more
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="c-1"))  # now neither has
    assert [a for a, _ in sent] == ["b:2"]
    (resp,) = [session.out.get_nowait()]
    assert resp.infer_response.id == "c-1" and resp.error_message.startswith("RESOURCE_EXHAUSTED")
    c = EditClient("127.0.0.1:1")
    futs = {i: Future() for i in ("c-0", "c-1")}
    for i, f in futs.items():
        c._pending[i] = (f, {})
    try:
        c._on_response(None, InferenceServerException(msg=resp.error_message))
        with pytest.raises(EditError) as err:
            futs["c-1"].result(0)
        assert err.value.code == "RESOURCE_EXHAUSTED" and not futs["c-0"].done()
    finally:
        c._pending.clear()
        c.close()
    assert "c-0" in {p.client_id for p in session.pending.values()}  # the admitted one is still in flight


# -- the watcher ----------------------------------------------------------------------------------
class _Call:
    def __init__(self, result=None, error=None):
        self._result, self._error = result, error

    def add_done_callback(self, cb):
        cb(self)

    def result(self):
        if self._error:
            raise self._error
        return self._result


class _NotFound(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.NOT_FOUND


def test_the_watcher_feeds_each_backend_its_own_statistics_and_skips_a_backend_without_the_model():
    resp = service_pb2.ModelStatisticsResponse()
    m = resp.model_stats.add(name="preprocess", version="1")
    m.inference_stats.success.count, m.inference_stats.compute_infer.ns = 3, 300 * MS
    seen = []
    backends = {
        "a:1": SimpleNamespace(addr="a:1", stub=SimpleNamespace(ModelStatistics=SimpleNamespace(
            future=lambda req, timeout: _Call(resp)))),
        "b:2": SimpleNamespace(addr="b:2", stub=SimpleNamespace(ModelStatistics=SimpleNamespace(
            future=lambda req, timeout: _Call(error=_NotFound())))),
    }
    r = SimpleNamespace(backends=backends, observe_admission=lambda b, d, busy: seen.append((b.addr, d, busy)))
    w = AdmissionWatcher(r)
    w.poll()
    w.poll()
    assert seen == [("a:1", 3, 300 * MS)] * 2 and w._missing == {"b:2"}


def test_an_edit_left_waiting_in_front_of_the_check_is_refused_on_its_own_stream_and_cancelled(router, monkeypatch):
    session, sent = _session(router, monkeypatch)
    cancelled = []
    monkeypatch.setattr(server, "_cancel_on_backend", lambda b, ids: cancelled.append((b.addr, ids)))
    router.backends["b:2"].load.healthy = False  # one backend, to keep the order plain
    for i in range(3):
        session.submit(service_pb2.ModelInferRequest(model_name="edit", id=f"c-{i}"))
    rids = [rid for _, rid in sent]
    a = router.backends["a:1"]
    for e in a.admission.entries.values():
        e.sent_at -= 1.0  # they were sent a second ago
    router.observe_admission(a, 0, 0)  # and the check has finished none: c-0 may be in it, c-1 and c-2 wait
    errors = [session.out.get_nowait() for _ in range(2)]
    assert [e.infer_response.id for e in errors] == ["c-1", "c-2"]
    assert all(e.error_message.startswith("RESOURCE_EXHAUSTED: waited") and "refused by the router" in e.error_message
               for e in errors)
    assert "[request id: c-1]" in errors[0].error_message  # EditClient matches it by this
    for _ in range(50):  # the cancel call runs in its own thread
        if cancelled:
            break
        time.sleep(0.01)
    assert cancelled == [("a:1", rids[1:])]
    assert list(session.pending) == [rids[0]] and a.load.inflight == 1
    # the backend answers them later (pre-processing dropped them): nothing reaches the client, the count clears
    a.admission.refused_at = float("-inf")
    for rid in rids[1:]:
        session.on_response(a, _final(rid, f"in ensemble 'edit', CANCELLED: cancelled before pre-processing "
                                           f"[request id: {rid}]"))
    assert not a.admission.refusing(time.monotonic())  # a cancel is no refusal
    session.on_response(a, _final("other", "in ensemble 'edit', RESOURCE_EXHAUSTED: denoise queue is full"))
    assert a.admission.refusing(time.monotonic())  # a refusal at its check is
    assert session.out.empty() and list(a.admission.entries) == [rids[0]]
    assert router.metrics.refused_on_behalf.labels("a:1", "dropped")._value.get() == 2  # as the router counted
    assert server._late_outcome("in ensemble 'edit', RESOURCE_EXHAUSTED: denoise queue is full") == "refused_there"
    assert server._late_outcome("in ensemble 'edit', CANCELLED: cancelled") == "admitted" == server._late_outcome("")
    session.on_response(a, _final(rids[0]))  # c-0 was admitted and is served
    assert session.out.get_nowait().infer_response.id == "c-0" and not a.admission.entries


def test_an_edit_that_ended_is_never_refused_by_the_timeout_too(router, monkeypatch):
    session, sent = _session(router, monkeypatch)
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="c-0"))
    (_, rid), = sent
    assert session.expire(rid) is True
    session.on_response(router.backends[sent[0][0]], _final(rid))  # the backend's answer came too late
    assert [r.infer_response.id for r in [session.out.get_nowait()]] == ["c-0"] and session.out.empty()
    session.submit(service_pb2.ModelInferRequest(model_name="edit", id="c-1"))
    rid1 = sent[1][1]
    session.on_response(router.backends[sent[1][0]], _final(rid1))
    assert session.expire(rid1) is False  # it had ended: one answer only


def _final(rid: str, error: str = ""):
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    resp.infer_response.id = rid
    resp.infer_response.parameters[server.FINAL].bool_param = True
    if not error:
        resp.infer_response.outputs.add(name="IMAGE")
    return resp


def test_the_poll_tick_refuses_on_time_even_when_the_backend_s_counts_are_slow_to_come(router, monkeypatch):
    session, sent = _session(router, monkeypatch)
    monkeypatch.setattr(server, "_cancel_on_backend", lambda b, ids: None)
    router.backends["b:2"].load.healthy = False
    for i in range(2):
        session.submit(service_pb2.ModelInferRequest(model_name="edit", id=f"c-{i}"))
    a = router.backends["a:1"]
    router.expire_admissions(a)  # the latest counts (from the fixture) say neither passed; both are new
    assert session.out.empty()
    for e in a.admission.entries.values():
        e.sent_at -= 1.0
    router.expire_admissions(a)  # no new counts: the tick alone refuses the one behind the check
    assert session.out.get_nowait().infer_response.id == "c-1" and session.out.empty()


# -- the watcher's pace: fast only where the counts can matter soon -----------------------------------
class _CountingStub:
    def __init__(self):
        self.calls = 0
        self.ModelStatistics = SimpleNamespace(future=self._future)

    def _future(self, req, timeout):
        self.calls += 1
        resp = service_pb2.ModelStatisticsResponse()
        resp.model_stats.add(name="preprocess", version="1")
        return _Call(resp)


def _paced(router, idle_interval_s=1.0):
    stubs = {}
    for addr, b in router.backends.items():
        b.admission.refused_at = float("-inf")  # neither refuses
        b.stub = stubs[addr] = _CountingStub()
    return AdmissionWatcher(router, interval_s=0.05, idle_interval_s=idle_interval_s), stubs


def test_the_watcher_polls_an_idle_backend_at_the_idle_pace_and_one_with_edits_waiting_at_every_tick(router):
    w, stubs = _paced(router)
    w.tick(100.0)  # never polled: both now
    assert {a: s.calls for a, s in stubs.items()} == {"a:1": 1, "b:2": 1}
    for i in range(1, 20):  # 0.95 s of ticks with nothing of the router's on either: neither asked again
        w.tick(100.0 + 0.05 * i)
    assert {a: s.calls for a, s in stubs.items()} == {"a:1": 1, "b:2": 1}
    _fill(router, "a:1", 1)  # an edit waits in front of a's check: a at every tick
    for i in range(20, 25):
        w.tick(100.0 + 0.05 * i)
    assert stubs["a:1"].calls == 6 and stubs["b:2"].calls == 2  # b: once more, a second after its last poll
    pace = router.metrics.admission_polls
    assert pace.labels("fast")._value.get() == 5 and pace.labels("idle")._value.get() == 3


def test_a_refusing_backend_is_polled_at_every_tick_with_nothing_of_the_router_s_waiting(router):
    w, stubs = _paced(router)
    w.tick(100.0)
    router.backends["b:2"].admission.backend_refused(100.01)  # its own refusal, seen in an answer
    for i in range(1, 5):
        w.tick(100.0 + 0.05 * i)
    assert stubs["b:2"].calls == 5 and stubs["a:1"].calls == 1


def test_the_tick_expires_only_where_edits_wait(router, monkeypatch):
    w, _ = _paced(router)
    _fill(router, "a:1", 2)
    expired = []
    monkeypatch.setattr(router, "expire_admissions", lambda b, now=None: expired.append(b.addr))
    w.tick(100.0)  # (after a's poll answer, and at the tick)
    assert expired == ["a:1", "a:1"]


def test_after_a_stall_every_backend_is_polled_at_the_next_tick(router, monkeypatch):
    w, stubs = _paced(router)
    w.tick(100.0)
    w.tick(100.05)
    assert stubs["a:1"].calls == 1
    monkeypatch.setattr(w.stall, "wait", lambda stop: (w._stop.is_set(), 30.0))
    monkeypatch.setattr(w, "tick", lambda now: (AdmissionWatcher.tick(w, 100.1), w._stop.set()))
    w._run()
    assert {a: s.calls for a, s in stubs.items()} == {"a:1": 2, "b:2": 2}
    assert all(b.admission.decided is not None for b in router.backends.values())  # counting again
