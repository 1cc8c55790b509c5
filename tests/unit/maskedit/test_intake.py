"""The ensemble's first step (``maskedit.intake``): the count in front of pre-processing, its refusal as every reader
takes it, the write-off of lost passes, the denoise queue's check on arrival and the arrival floor. No server."""

import json

import numpy as np
import pytest

from maskedit.admission import QueueBoard
from maskedit.errors import ResourceExhausted
from maskedit.intake import Intake, floor_of
from maskedit_client.results import EditError
from maskedit_common.triton_refusals import as_refusal
from maskedit_lab.reliability.overload import backend_source

G = 0.25


def _intake(tmp_path, now=0.0):
    """(intake, pre-processing's view of the same board)"""
    return Intake(QueueBoard(tmp_path / "b"), max_waiting=16, idle_gap_s=G, now=now), QueueBoard(tmp_path / "b")


def test_it_passes_while_fewer_than_16_wait_refuses_the_17th_and_passes_once_pre_processing_starts_one(tmp_path):
    intake, pre = _intake(tmp_path)
    pre.preprocess_started(from_intake=False)  # busy with a direct call: nothing is written off meanwhile
    for i in range(16):
        assert intake.decide(1.0 + i * 0.001)["waiting"] == i
    with pytest.raises(ResourceExhausted, match=r"pre-processing's queue is full \(16 waiting; refused on arrival"):
        intake.decide(1.02)
    pre.preprocess_started(from_intake=True)  # it took one
    assert intake.decide(1.03)["waiting"] == 15
    with pytest.raises(ResourceExhausted):
        intake.decide(1.04)
    assert pre.waiting_for_preprocess() == 16


def test_its_refusal_reads_as_a_refusal_to_the_router_the_client_and_the_lab(tmp_path):
    intake, pre = _intake(tmp_path)
    pre.preprocess_started(from_intake=False)
    for i in range(16):
        intake.decide(1.0)
    with pytest.raises(ResourceExhausted) as e:
        intake.decide(1.0)
    # as the Python backend sends it (maskedit.triton.io.error_text) and the ensemble wraps it
    text = f"in ensemble 'edit', {e.value.code}: {e.value} [request id: r-7]"
    assert as_refusal(text) == text and "RESOURCE_EXHAUSTED" in as_refusal(text)  # the router retries elsewhere
    assert EditError.from_server(text).code == "RESOURCE_EXHAUSTED"
    assert backend_source(text) == "intake_full"
    assert backend_source("UNAVAILABLE: RESOURCE_EXHAUSTED: denoise queue is full (8 waiting)") == "queue_full"


def test_lost_passes_are_written_off_once_pre_processing_idles_longer_than_the_gap(tmp_path):
    intake, pre = _intake(tmp_path)
    pre.preprocess_idle(0.5)
    for i in range(5):
        intake.decide(1.0 + i * 0.01)  # passed on, never started (a reload lost them)
    assert intake.waiting(1.1) == 5  # idle only 0.6 s but they were passed within G: may still be on their way
    assert intake.waiting(1.0 + 0.04 + G + 0.01) == 0  # none recent, idle > G: nothing can still be waiting
    assert pre.waiting_for_preprocess() == 0
    intake.decide(3.0)
    intake.decide(3.01)
    assert intake.waiting(3.05) == 2  # never written off below its recent passes
    pre.preprocess_started(from_intake=True)
    pre.preprocess_started(from_intake=True)
    assert intake.waiting(3.06) == 0
    pre.preprocess_started(from_intake=True)  # a pass written off that started after all: never below 0
    assert intake.waiting(3.07) == 0 and pre.waiting_for_preprocess() == 0


def test_busy_pre_processing_is_never_written_off(tmp_path):
    intake, pre = _intake(tmp_path)
    pre.preprocess_started(from_intake=False)  # busy (idle since 0) however long
    for i in range(3):
        intake.decide(1.0 + i)
    assert intake.waiting(100.0) == 3


def test_a_full_denoise_queue_is_refused_at_intake(tmp_path):
    intake, pre = _intake(tmp_path)
    denoise = QueueBoard(tmp_path / "b")
    denoise.publish(8, 8)
    with pytest.raises(ResourceExhausted, match="denoise queue is full"):
        intake.decide(1.0)
    assert pre.waiting_for_preprocess() == 0  # refused: not counted as waiting
    denoise.publish(8, 8, {"heavy": 8.0})
    assert intake.decide(1.1, tenant="light")["waiting"] == 0  # a lighter tenant still gets a place


def test_the_floor(tmp_path):
    intake, _ = _intake(tmp_path, now=0.0)
    info = intake.decide(5.0)
    assert info["floor_ts"] == 5.0 - G and info["received_ts"] == 5.0  # after an idle spell: start - G
    intake.ran(5.0, 5.001)
    for i in range(1, 10):  # back to back: the busy run's start - G
        s = 5.0 + i * 0.002
        f = intake.decide(s)["floor_ts"]
        assert f == 5.0 - G and f <= s
        intake.ran(s, s + 0.001)
    assert intake.decide(0.1)["floor_ts"] <= 0.1  # never later than its start


def test_pre_processing_reads_the_floor_and_nothing_else():
    info = json.dumps({"floor_ts": 12.5, "received_ts": 12.7, "waiting": 3}).encode()
    assert floor_of(np.array([info], dtype=np.object_)) == 12.5 and floor_of(info) == 12.5
    for bad in (b"{", b"[]", json.dumps({"floor_ts": "soon"}).encode(), json.dumps({"floor_ts": -1}).encode(),
                b'{"floor_ts": NaN}', np.array([info, info], dtype=np.object_), b"{}"):
        assert floor_of(bad) is None
