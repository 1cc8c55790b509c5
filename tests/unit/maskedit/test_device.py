"""CPU behaviour of the device layer (the CUDA side runs in tests/gpu): streams and events vanish, host buffers are
plain memory, step times are the wall clock."""

import time

import torch

from maskedit.cache.cost_model import device_slug, profile_path
from maskedit.device import SideStream, StepClock, host_empty, seconds_between, time_mark, wait


def test_on_the_cpu_side_streams_run_inline_and_events_are_none():
    s = SideStream.shared("cpu", "load")
    assert s is SideStream.shared("cpu", "load") and not s.cuda
    x = torch.zeros(3)
    with s.after():
        x += 1
    assert s.mark() is None and x.tolist() == [1, 1, 1]
    t0 = time_mark("cpu")
    assert isinstance(t0, float) and seconds_between(t0, time_mark("cpu")) >= 0
    wait(None)
    assert not host_empty((4, 4), torch.bfloat16, "cpu").is_pinned()


def test_step_clock_reports_each_step_once_with_its_tokens():
    clock = StepClock("cpu")
    for tokens in (10, 20):
        clock.begin(tokens)
        time.sleep(0.01)
        clock.end()
        clock.bound(1)
    done = clock.finished()
    assert [t for t, _ in done] == [10, 20] and all(s >= 0.009 for _, s in done)
    assert clock.finished() == []


def test_cost_profiles_are_named_by_model_and_hardware(tmp_path):
    assert device_slug("cpu") == "cpu"
    assert profile_path(tmp_path, "bench-flux-fill", "cpu") == tmp_path / "cost_model_bench-flux-fill.json"
