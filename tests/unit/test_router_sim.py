"""The router simulator's worker model: step-level batching, template caching, host CPU contention."""

import pytest

from maskedit.cache.cost_model import CostModel
from maskedit_router.features import EditFeatures
from maskedit_router.policies import Estimator
from maskedit_router.simulate import replay


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
    # host work of an isolated request slows nobody
    (q2,) = replay("round_robin", 1, [(0.0, f())], est, host_ms=500.0)["requests"]
    assert latency(q2) == pytest.approx(latency(q))


def test_second_request_on_a_template_is_a_hit(est):
    out = replay("round_robin", 1, [(0.0, f()), (100.0, f())], est)
    first, second = out["requests"]
    assert latency(second) < latency(first) / 2


def test_requests_share_steps_and_host_work_slows_the_running_batch(est):
    arr = [(0.0, f("a")), (0.001, f("b"))]
    alone = latency(replay("round_robin", 1, arr[:1], est)["requests"][0])
    shared = replay("round_robin", 1, arr, est)["requests"]
    assert latency(shared[0]) > alone  # the second joined at the next step and lengthened the steps
    contended = replay("round_robin", 1, arr, est, host_ms=300.0)["requests"]
    # the first request's step in flight is lengthened by the second's pre-processing, the second's next step by
    # the first's post-processing
    assert latency(contended[0]) == pytest.approx(latency(shared[0]) + 0.15)
    assert latency(contended[1]) == pytest.approx(latency(shared[1]) + 0.3)
    # with two workers each request runs alone
    spread = replay("round_robin", 2, arr, est, host_ms=300.0)["requests"]
    assert latency(spread[0]) == pytest.approx(alone)
