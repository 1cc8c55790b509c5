"""When a request arrived (``maskedit.arrival``): its sender's stamp, else a lower bound inferred from pre-processing's
executions; what reads the stamp (pre-processing's front check). Who writes it: ``maskedit_client/test_sent_stamp.py``,
``maskedit_router/proxy/test_stamp.py``. No server."""

import json
import time

import pytest

from maskedit.admission import FrontCheck, QueueBoard
from maskedit.arrival import INFERRED, STAMP, STAMP_OTHER_HOST, ArrivalBound, SentStamp, sent_stamp
from maskedit.completion import Backlog
from maskedit.errors import DeadlineExceeded, InvalidInput, ResourceExhausted
from maskedit_common import sent_stamp as wire

HERE = "boot-id-of-this-host"

# A flood straight at one server (tests/integration/test_flood.py's, 48 requests on one stream, 2-core host at load
# 5-7), as pre-processing and the client saw it: (sent, pre-processing start, end) in seconds from the first send, one
# row per execution in order. After each short execution (a refusal) Triton's dynamic batcher left the instance idle
# ~0.5 s with 15 requests waiting in its queue (its 500 ms poll); before that, two warm-up edits 6 s apart.
WARM_UP = [(-17.43, -17.12), (-6.15, -6.01)]
FLOOD = [(0.0, 0.06, 0.28), (0.03, 0.29, 0.71), (0.04, 0.78, 1.55), (0.06, 1.57, 1.57), (0.08, 2.07, 2.63),
         (0.1, 3.08, 3.08), (0.11, 3.59, 3.59), (0.12, 3.59, 3.59), (0.13, 3.59, 3.6), (0.15, 4.1, 4.1),
         (0.16, 4.6, 5.05), (0.18, 5.11, 5.11), (0.21, 5.61, 5.61), (0.24, 6.11, 6.42), (0.27, 6.42, 6.42),
         (0.32, 6.93, 6.93), (0.36, 7.44, 7.91), (0.39, 7.94, 8.35), (0.78, 8.44, 8.44)]


def _replay(a: ArrivalBound) -> list[float]:
    """How much later than it was sent each flood request was thought to have arrived (> 0: its wait under-counted)."""
    for s, e in WARM_UP:
        a.ran(s, e)
    late = []
    for sent, s, e in FLOOD:
        late.append(a.earliest(s) - sent)
        a.ran(s, e)
    return late


def test_a_recorded_flood_is_never_thought_younger_than_it_was():
    late = _replay(ArrivalBound(queue_size=16, clock=HERE, now=-30.0))
    assert max(late) <= 0, late
    assert min(late) > -2.0, late  # over-counted by the idle allowance, not by the whole flood
    # the 0.25 s allowance assumed before read the batcher's 0.5 s pauses as an empty queue: waits of up to 6.8 s
    # counted as 0.25 s (what let requests with a 1.5 s DEADLINE_MS be served 6 s late)
    assert max(_replay(ArrivalBound(queue_size=16, idle_gap_s=0.25, clock=HERE, now=-30.0))) > 6.0


def test_an_idle_instance_bounds_the_wait_by_its_last_execution():
    a = ArrivalBound(queue_size=3, clock=HERE, now=0.0)
    assert a.earliest(5.0) == 4.0  # the first request, long after the model was ready: it waited at most 1 s
    a.ran(5.0, 6.0)
    assert a.earliest(9.0) == 8.0  # idle from 6 to 9: nothing waited until 8
    a.ran(9.0, 9.5)
    assert a.earliest(9.5) == 8.0  # right behind the one started after the idle gap
    a.ran(9.5, 10.0)
    assert a.earliest(10.6) == 8.0  # a pause of 0.6 s (the batcher's poll) is no idle gap: it may have waited


def test_back_to_back_executions_bound_the_wait_by_the_queue_and_what_triton_took_out_of_it():
    a = ArrivalBound(queue_size=3, clock=HERE, now=0.0)
    for i in range(20):
        a.ran(10.0 + i, 11.0 + i)  # busy since 10: 20 executions back to back
    # at most 2 waiting ahead of it, 2 taken out of the queue for the instance and one running: it arrived no
    # earlier than the 6th execution before its own started
    assert a.earliest(30.0) == 24.0
    a.ran(30.0, 30.01)
    assert a.earliest(31.5) == 30.5  # a gap of 1.49 s: the instance was idle, it arrived at most 1 s ago


def test_a_stamp_of_this_host_is_the_arrival_another_hosts_is_believed_within_the_skew():
    a = ArrivalBound(queue_size=16, skew_s=0.05, clock=HERE, now=0.0)
    for i in range(30):
        a.ran(100.0 + 0.3 * i, 100.3 + 0.3 * i)  # a flood since 100
    start = 109.0
    assert a.earliest(start) == pytest.approx(103.3)  # inferred: 19 executions back
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
    a = ArrivalBound(queue_size=16, skew_s=0.05, clock=HERE, now=0.0)
    got = a.arrival(50.0, SentStamp(51.0, clock))  # a clock running ahead: no time it was sent
    assert (got.at, got.source) == (a.earliest(50.0), INFERRED) and "after it reached pre-processing" in got.note


def test_an_unknown_host_clock_never_matches():
    a = ArrivalBound(queue_size=16, skew_s=0.05, clock="", now=0.0)  # a host without a boot id
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
    front = FrontCheck(pre, 10.0, max_batch=4, max_tokens=1 << 30, queue_size=16, full_tokens=256)
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
