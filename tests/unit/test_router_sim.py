"""The router simulator's worker model: step-level batching, template caching, CPU hosts shared by processor
sharing with single-instance pre/post-processing queues."""

import pytest

from maskedit.cache.cost_model import CostModel
from maskedit_router.features import EditFeatures
from maskedit_router.policies import Estimator
from maskedit_router.simulate import HostModel, replay


@pytest.fixture(scope="module")
def est():
    return Estimator(CostModel.fallback())


def f(template="a", ratio=0.2, steps=4):
    return EditFeatures(template, ratio, 1024, steps)


def latency(q):
    return q.done - q.arrival


def test_isolated_request_takes_its_service_time(est):
    out = replay("round_robin", 1, [(0.0, f())], est, step_fixed_ms=2.0)
    (q,) = out["requests"]
    expected = (est.request_ms(f(), False) + 4 * 2.0) / 1000  # a miss: the full model, then fixed cost per step
    assert latency(q) == pytest.approx(expected)
    assert q.denoised - q.started == pytest.approx(expected)
    # on a CPU host with a core to spare, pre/post-processing only add their own time
    host = HostModel(cores=2, workers_per_host=1, pre_ms=100.0, post_ms=200.0)
    (q2,) = replay("round_robin", 1, [(0.0, f())], est, host=host)["requests"]
    assert latency(q2) == pytest.approx(latency(q) + 0.3)
    assert q2.started == pytest.approx(0.1)


def test_second_request_on_a_template_is_a_hit(est):
    out = replay("round_robin", 1, [(0.0, f()), (100.0, f())], est)
    first, second = out["requests"]
    assert latency(second) < latency(first) / 2


def test_requests_share_steps(est):
    arr = [(0.0, f("a")), (0.001, f("b"))]
    alone = latency(replay("round_robin", 1, arr[:1], est)["requests"][0])
    shared = replay("round_robin", 1, arr, est)["requests"]
    assert latency(shared[0]) > alone  # the second joined at the next step and lengthened the steps
    assert shared[1].started > arr[1][0]  # it waited for the step boundary
    spread = replay("round_robin", 2, arr, est)["requests"]  # with two workers each request runs alone
    assert latency(spread[0]) == pytest.approx(alone)


def test_workers_on_one_host_share_its_cores(est):
    arr = [(0.0, f("a")), (0.0, f("b"))]
    alone = latency(replay("round_robin", 1, arr[:1], est)["requests"][0])
    two_cores = replay("round_robin", 2, arr, est, host=HostModel(2, 2, 0.0, 0.0))["requests"]
    one_core = replay("round_robin", 2, arr, est, host=HostModel(1, 2, 0.0, 0.0))["requests"]
    for q in two_cores:
        assert latency(q) == pytest.approx(alone)
    for q in one_core:  # two denoise loops on one core: each at half speed
        assert latency(q) == pytest.approx(2 * alone)
    apart = replay("round_robin", 2, arr, est, host=HostModel(1, 1, 0.0, 0.0))["requests"]  # a host each
    for q in apart:
        assert latency(q) == pytest.approx(alone)


def test_pre_processing_queues_per_worker_and_slows_a_busy_host(est):
    host = HostModel(cores=1, workers_per_host=1, pre_ms=100.0, post_ms=0.0)
    a, b = replay("round_robin", 1, [(0.0, f("a")), (0.0, f("b"))], est, host=host)["requests"]
    assert a.started == pytest.approx(0.1)  # one pre-processing instance: b's waits for a's ...
    # ... then shares the single core with a's first step (both at half speed until b's ends at 0.3 s), and b
    # joins the batch when that step ends
    step_ms = est.request_ms(f("a"), False) / 4 + 2.0
    assert step_ms > 100.0
    assert b.started == pytest.approx(0.3 + (step_ms - 100.0) / 1000)
    solo = replay("round_robin", 1, [(0.0, f("a"))], est, host=host)["requests"][0]
    assert latency(a) > latency(solo)
