"""When a request arrived (``maskedit.arrival``): its sender's stamp, else a lower bound inferred from pre-processing's
executions; what reads the stamp (pre-processing's front check). Who writes it: ``maskedit_client/test_sent_stamp.py``,
``maskedit_router/proxy/test_stamp.py``. No server."""

import json
import random
import time

import pytest

from maskedit.admission import FrontCheck, QueueBoard
from maskedit.arrival import INFERRED, STAMP, STAMP_OTHER_HOST, ArrivalBound, SentStamp, sent_stamp
from maskedit.completion import Backlog
from maskedit.errors import DeadlineExceeded, InvalidInput, ResourceExhausted
from maskedit_common import sent_stamp as wire

HERE = "boot-id-of-this-host"

G = 0.25


def test_an_idle_instance_bounds_the_wait_by_the_idle_gap():
    a = ArrivalBound(idle_gap_s=G, clock=HERE, now=0.0)
    assert a.earliest(0.1) == 0.0  # right after the model became ready: nothing reached it before
    assert a.earliest(5.0) == 5.0 - G  # the first request, long after: it waited at most G
    a.ran(5.0, 6.0)
    assert a.earliest(9.0) == 9.0 - G  # idle from 6 to 9: nothing waited until 9 - G
    a.ran(9.0, 9.5)
    assert a.earliest(9.5) == 9.0 - G  # right behind the one started after the idle gap: the busy run's floor
    a.ran(9.5, 10.0)
    assert a.earliest(10.2) == 9.0 - G  # a pause within G is no idle gap: it may have waited


def test_back_to_back_executions_bound_the_wait_by_the_busy_run():
    a = ArrivalBound(idle_gap_s=G, clock=HERE, now=0.0)
    for i in range(20):
        a.ran(10.0 + i, 11.0 + i)  # busy since 10: 20 executions back to back
    # requests start in arrival order, and the run's first arrived at most G before it began
    assert a.earliest(30.0) == 10.0 - G
    a.ran(30.0, 30.01)
    assert a.earliest(31.5) == 31.5 - G  # a gap of 1.49 s: the instance was idle, it arrived at most G ago


def _fifo(arrivals: list[float], service, handover) -> list[tuple[float, float, float]]:
    """(arrival, start, end) of each request of one FIFO server under Triton's default scheduler: a request starts
    within ``handover(i)`` of the later of its arrival and the previous end."""
    out, free = [], 0.0
    for i, t in enumerate(arrivals):
        start = max(t, free) + handover(i)
        free = start + service(i)
        out.append((t, start, free))
    return out


def _floors(trace, idle_gap_s):
    a = ArrivalBound(idle_gap_s=idle_gap_s, clock=HERE, now=0.0)
    floors = []
    for _, s, e in trace:
        floors.append(a.earliest(s))
        a.ran(s, e)
    return floors


@pytest.mark.parametrize("seed", range(20))
def test_intake_floor_never_later_than_arrival(seed):
    """Simulated traces of one FIFO server (intake: 0.5-5 ms a request, bursts and quiet spells, hand-over within
    G): no request is thought younger than it was, and the over-count is at most its busy run plus G."""
    rng = random.Random(seed)
    t, arrivals = 1.0, []
    for _ in range(400):
        t += rng.choice([rng.uniform(0, 0.002), rng.uniform(0, 0.05), rng.uniform(0.2, 1.0)])
        arrivals.append(t)
    trace = _fifo(arrivals, lambda i: rng.uniform(0.0005, 0.005), lambda i: rng.uniform(0, G * 0.9))
    floors = _floors(trace, G)
    run_start = 0.0
    for k, ((arrived, start, _), floor) in enumerate(zip(trace, floors)):
        if k == 0 or start - trace[k - 1][2] > G:
            run_start = start
        assert floor <= arrived, (k, floor, arrived)
        assert arrived - floor <= (start - run_start) + G + 1e-9, (k, arrived - floor, start - run_start)


def test_a_hand_over_longer_than_the_idle_gap_under_counts():
    """The floor rests on G: a waiting request handed over later than G (a starved or stopped stub) is read as
    having arrived after an idle gap, and its wait is under-counted."""
    trace = _fifo([1.0, 1.001], lambda i: 0.002, lambda i: 0.0 if i == 0 else 2 * G)
    floors = _floors(trace, G)
    assert floors[1] > trace[1][0]  # thought younger than it was


def test_a_stamp_of_this_host_is_the_arrival_another_hosts_is_believed_within_the_skew():
    a = ArrivalBound(skew_s=0.05, clock=HERE, now=0.0)
    for i in range(30):
        a.ran(100.0 + 0.3 * i, 100.3 + 0.3 * i)  # a flood since 100
    start = 109.0
    assert a.earliest(start) == pytest.approx(100.0 - a.idle_gap_s)  # inferred: the busy run's start
    got = a.arrival(start, SentStamp(101.0, HERE))
    assert (got.at, got.source, got.note) == (101.0, STAMP, "")  # the fact, even where inference says less
    got = a.arrival(start, SentStamp(108.9, HERE))
    assert (got.at, got.source) == (108.9, STAMP)  # and where it says more (it did not wait)
    got = a.arrival(start, SentStamp(108.0, "another-host"))
    assert (got.at, got.source) == (pytest.approx(107.95), STAMP_OTHER_HOST)
    got = a.arrival(start, SentStamp(start + 0.04, "another-host"))  # its clock a little ahead: within the skew
    assert got.at <= start and got.source == STAMP_OTHER_HOST
    assert a.arrival(start, SentStamp(1.0, "another-host")).at == 1.0 - 0.05  # believed: refused as waited too long
    assert a.arrival(start, None) == a.arrival(start) and a.arrival(start).source == INFERRED


@pytest.mark.parametrize("clock", [HERE, "another-host", ""])
def test_a_stamp_after_the_request_reached_pre_processing_is_set_aside(clock):
    a = ArrivalBound(skew_s=0.05, clock=HERE, now=0.0)
    got = a.arrival(50.0, SentStamp(51.0, clock))  # a clock running ahead: no time it was sent
    assert (got.at, got.source) == (a.earliest(50.0), INFERRED) and "after it reached pre-processing" in got.note


def test_an_unknown_host_clock_never_matches():
    a = ArrivalBound(skew_s=0.05, clock="", now=0.0)  # a host without a boot id
    assert a.arrival(10.0, SentStamp(9.0, "")).source == STAMP_OTHER_HOST


def test_the_stamp_is_read_from_the_request_parameters_and_a_bad_one_names_its_parameter():
    assert sent_stamp(json.dumps({"maskedit_sent_at": 12.5, "maskedit_sent_clock": HERE})) == SentStamp(12.5, HERE)
    assert sent_stamp({"maskedit_sent_at": "12.5"}) == SentStamp(12.5, "")  # as text: a header, a JSON body
    assert sent_stamp(json.dumps({"maskedit_tenant": "acme"})) is None and sent_stamp(None) is None
    for bad in ("soon", True, float("nan"), -1.0, [1.0]):
        with pytest.raises(InvalidInput) as e:
            sent_stamp({"maskedit_sent_at": bad})
        assert e.value.field == "maskedit_sent_at" and "repr" not in str(e.value)
    with pytest.raises(InvalidInput) as e:
        sent_stamp({"maskedit_sent_at": 1.0, "maskedit_sent_clock": 7})
    assert e.value.field == "maskedit_sent_clock"


def test_the_wire_names_are_the_backends():
    assert (wire.SENT_AT, wire.SENT_CLOCK) == ("maskedit_sent_at", "maskedit_sent_clock")
    s = wire.stamp(now=5.0, clock="b")
    assert sent_stamp(s) == SentStamp(5.0, "b") and sent_stamp(wire.stamp()).clock == wire.host_clock()


# -- pre-processing's check counts from the stamp ------------------------------------------------------------
def _front(tmp_path):
    denoise, pre = QueueBoard(tmp_path / "b"), QueueBoard(tmp_path / "b")
    denoise.publish_backlog(Backlog([], [], 0.0, 0.0002, 256.0))  # ~0.05 s a step alone
    front = FrontCheck(pre, 10.0, max_batch=4, max_tokens=1 << 30, full_tokens=256)
    front.arrivals.clock = HERE
    return front


def test_a_request_stamped_long_before_it_reached_pre_processing_is_refused_before_any_work(tmp_path):
    front = _front(tmp_path)
    now = time.time()
    a = front.admit(now, 20, 1500, SentStamp(now - 0.2, HERE))
    assert (a.arrival.at, a.arrival.source, a.bound.spent) == (now - 0.2, STAMP, pytest.approx(0.2))
    # waited 6 s in Triton's queue: past its 1.5 s DEADLINE_MS whatever is ahead (what the old inference admitted)
    with pytest.raises(DeadlineExceeded, match=r"within 1500 ms of its arrival, 6\.0 s of them spent waiting"):
        front.admit(now, 20, 1500, SentStamp(now - 6.0, HERE))
    with pytest.raises(ResourceExhausted, match=r"within 10 s of its arrival .*11\.0 s of them spent waiting"):
        front.admit(now, 20, None, SentStamp(now - 11.0, HERE))  # the server's bound counts from it too
