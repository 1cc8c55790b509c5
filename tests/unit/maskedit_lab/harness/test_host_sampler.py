"""The host sampler: the tested processes' CPU (their whole tree) apart from the rest of the host's."""

import subprocess
import sys
import time

import psutil
import pytest

from maskedit_lab.harness.host_sampler import HostSampler
from maskedit_lab.routing.validate_replay import background

SPIN = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']).wait()"


def test_a_tested_process_trees_cpu_is_counted_as_tested_not_foreign():
    parent = subprocess.Popen([sys.executable, "-c", SPIN])  # the spinning process is the tested one's child
    name = psutil.Process(parent.pid).name()
    try:
        t0 = time.monotonic()
        with HostSampler(lambda: [parent.pid], interval_s=0.5) as hs:
            time.sleep(2.2)
        samples = hs.between(t0, time.monotonic())
    finally:
        for c in psutil.Process(parent.pid).children(recursive=True):
            c.kill()
        parent.kill()
        parent.wait(10)
    assert len(samples) >= 3
    assert all(0 <= s["t"] <= 3 for s in samples)
    # the grandchild spins a whole core when it gets one; a busy host may give it less, never none
    assert max(s["tested_cores"] for s in samples) > 0.3
    # split by what each process is (not a Triton stub: its process name), summing to the tested CPU
    for s in samples:
        assert s["foreign_cores"] == pytest.approx(max(0.0, s["busy_cores"] - s["tested_cores"]), abs=2e-3)
        assert set(s["by_model"]) <= {name}
        assert sum(s["by_model"].values()) == pytest.approx(s["tested_cores"], abs=0.01)
    # nothing tested (no pid): the spinner's CPU is foreign
    idle = HostSampler(lambda: [])
    assert idle._tested_cpu_s() == {}


def test_a_tested_process_is_known_by_pid_and_start_time_and_forgotten_when_gone():
    """A pid reused by a new process (a restarted stub) is another process: its CPU is not set against the old one's,
    nor does it keep the old one's label; a process that has gone leaves nothing behind."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pids = [child.pid]
    try:
        hs = HostSampler(lambda: pids)
        got = hs._tested_cpu_s()
        assert set(got) == {(child.pid, psutil.Process(child.pid).create_time())}
        assert set(hs._labels) == set(got)
    finally:
        child.kill()
        child.wait(10)
    assert hs._tested_cpu_s() == {} and hs._labels == {}  # exited (its pid still asked for): forgotten


def test_the_largest_foreign_cpu_users_are_named():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # not tested: foreign
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        with HostSampler(lambda: [], interval_s=0.5) as hs:
            time.sleep(2.2)
        samples = hs.between(t0, time.monotonic())
    finally:
        spinner.kill()
        spinner.wait(10)
    name = psutil.Process().name()  # the same interpreter: a Python program run with -c is named by it
    assert len(samples) >= 3
    # it spins a whole core when it gets one; a busy host may give it less, never none
    assert max(s["foreign_top"].get(name, 0.0) for s in samples) > 0.3
    assert all(len(s["foreign_top"]) <= 3 and sum(s["foreign_top"].values()) <= s["busy_cores"] + 0.1
               for s in samples)


def test_samples_become_background_steps_from_the_sample_before():
    samples = [{"t": 1.0, "foreign_cores": 0.5}, {"t": 2.1, "foreign_cores": 1.5}]
    assert background(samples) == ((0.0, 0.5), (1.0, 1.5))
    assert background([]) == ()
    # the calibration ran under 0.8 foreign cores: only what is above that slows the replay
    assert background(samples, calibrated=0.8) == ((0.0, 0.0), (1.0, 0.7))


def test_the_worst_window_is_where_measured_denoise_most_exceeds_the_replays_with_the_host_beside_it():
    from types import SimpleNamespace

    from maskedit_lab.routing.validate_replay import worst_window

    # 10 requests a window for 3 windows of 15 s; the middle one measured twice the simulated denoise time
    reqs, sim = [], []
    for k in range(30):
        slow = 15 <= 1.5 * k < 30
        reqs.append({"t": 1.5 * k, "error": None, "denoise_s": 2.0 if slow else 1.0})
        sim.append(SimpleNamespace(started=0.0, denoised=1.0))
    host = [{"t": float(t), "foreign_cores": 1.0 if 16 <= t <= 30 else 0.1, "tested_cores": 1.5,
             "foreign_top": {"kworker": 0.9} if 16 <= t <= 30 else {"router": 0.1}} for t in range(1, 46)]
    w = worst_window({"requests": reqs, "host": host}, sim)
    assert (w["t0_s"], w["t1_s"], w["denoise_ratio"], w["run_denoise_ratio"], w["requests"]) == (15.0, 30.0, 2.0,
                                                                                                1.0, 10)
    assert w["foreign_cores"] > 0.7 and w["run_foreign_cores"] < 0.45
    assert list(w["foreign_top"]) == ["kworker", "router"] and w["foreign_top"]["kworker"] > 0.6
    assert "foreign_cores" not in worst_window({"requests": reqs}, sim)  # older files: no host samples
    assert worst_window({"requests": reqs[:3]}, sim[:3]) is None  # no window with enough requests
