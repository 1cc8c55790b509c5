"""The host sampler: the tested processes' CPU (their whole tree) apart from the rest of the host's."""

import subprocess
import sys
import time

from maskedit_lab.harness.host_sampler import HostSampler
from maskedit_lab.routing.validate_replay import background

SPIN = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']).wait()"


def test_a_tested_process_trees_cpu_is_counted_as_tested_not_foreign():
    parent = subprocess.Popen([sys.executable, "-c", SPIN])  # the spinning process is the tested one's child
    try:
        t0 = time.monotonic()
        with HostSampler(lambda: [parent.pid], interval_s=0.5) as hs:
            time.sleep(2.2)
        samples = hs.between(t0, time.monotonic())
    finally:
        import psutil

        for c in psutil.Process(parent.pid).children(recursive=True):
            c.kill()
        parent.kill()
        parent.wait(10)
    assert len(samples) >= 3
    assert all(0 <= s["t"] <= 3 for s in samples)
    # the grandchild spins a whole core when it gets one; a busy host may give it less, never none
    assert max(s["tested_cores"] for s in samples) > 0.3
    for s in samples:
        assert s["foreign_cores"] == max(0.0, round(s["busy_cores"] - s["tested_cores"], 3)) or \
            abs(s["foreign_cores"] - (s["busy_cores"] - s["tested_cores"])) < 2e-3
    # nothing tested (no pid): the spinner's CPU is foreign
    idle = HostSampler(lambda: [])
    assert idle._tested_cpu_s() == 0.0


def test_samples_become_background_steps_from_the_sample_before():
    samples = [{"t": 1.0, "foreign_cores": 0.5}, {"t": 2.1, "foreign_cores": 1.5}]
    assert background(samples) == ((0.0, 0.5), (1.0, 1.5))
    assert background([]) == ()
    # the calibration ran under 0.8 foreign cores: only what is above that slows the replay
    assert background(samples, calibrated=0.8) == ((0.0, 0.0), (1.0, 0.7))
