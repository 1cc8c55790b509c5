"""Algorithm 1: the dynamic program equals brute force on random costs."""

import random

import pytest

from maskedit.cache.planner import FULL, KV, MODES, Y, BlockCost, brute_force, evaluate, plan


def random_costs(rng: random.Random, n: int, missing: float = 0.15) -> list[BlockCost]:
    out = []
    for _ in range(n):
        full = rng.uniform(1, 10)
        out.append(BlockCost(
            compute_full=full, compute_y=full * rng.uniform(0.1, 1.2), compute_kv=full * rng.uniform(0.05, 1.0),
            load_y=None if rng.random() < missing else rng.uniform(0, 12),
            load_kv=None if rng.random() < missing else rng.uniform(0, 20),
        ))
    return out


@pytest.mark.parametrize("n", range(1, 13))
def test_two_mode_dp_equals_brute_force_over_2_to_the_n(n):
    rng = random.Random(1000 + n)
    for _ in range(20):
        costs = random_costs(rng, n)
        dp, bf = plan(costs, (FULL, Y)), brute_force(costs, (FULL, Y))
        assert dp.latency_ms == pytest.approx(bf.latency_ms, abs=1e-9)
        assert evaluate(costs, dp.modes) == pytest.approx(dp.latency_ms, abs=1e-9)


@pytest.mark.parametrize("n", range(1, 9))
def test_three_mode_dp_equals_brute_force(n):
    rng = random.Random(2000 + n)
    for _ in range(20):
        costs = random_costs(rng, n)
        dp, bf = plan(costs, MODES), brute_force(costs, MODES)
        assert dp.latency_ms == pytest.approx(bf.latency_ms, abs=1e-9)
        assert evaluate(costs, dp.modes) == pytest.approx(dp.latency_ms, abs=1e-9)


def test_slow_loads_are_hidden_or_skipped():
    # Loading is dearer than computing: caching every block would stall; the plan caches what hides.
    costs = [BlockCost(10, 2, 1, 9, None) for _ in range(6)]
    p = plan(costs, (FULL, Y))
    assert p.latency_ms < evaluate(costs, (Y,) * 6) and p.latency_ms < evaluate(costs, (FULL,) * 6)
    # Free loads: every block uses the cache.
    assert plan([BlockCost(10, 2, 1, 0.0, 0.0)] * 4).modes == (KV,) * 4


def test_missing_rows_force_full():
    costs = [BlockCost(5, 1, 1, None, None), BlockCost(5, 1, 1, 0.1, None)]
    assert plan(costs).modes == (FULL, Y)
    # a kv block followed by y needs its output rows, which were not recorded: not allowed
    costs = [BlockCost(5, 1, 0.5, None, 0.1), BlockCost(5, 1, 1, 0.1, None)]
    assert evaluate(costs, (KV, Y)) == float("inf")
