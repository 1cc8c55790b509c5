import json

import numpy as np
import pytest

from maskedit_common.blocks import FULL, KV, Y
from maskedit_common.cost_model import CostModel, LinearFit, features
from maskedit_common.flops import block_flops, ideal_speedup


def test_linear_fit_recovers_coefficients_and_r2():
    rng = np.random.default_rng(0)
    xs = [[1.0, a, b, c] for a, b, c in rng.random((50, 3))]
    ys = [2 + 3 * x[1] + 0.5 * x[2] + 7 * x[3] for x in xs]
    f = LinearFit.fit(xs, ys)
    assert f.r2 > 0.999 and f.coef == pytest.approx([2, 3, 0.5, 7], abs=1e-6)


def test_cost_model_json_roundtrip_and_costs():
    fits = {m: LinearFit([0.1, 1.0, 0.2, 0.5], 0.99) for m in (FULL, Y, KV)}
    cm = CostModel(compute={"dual": fits, "single": fits}, load={"mem": LinearFit([0.0, 0.1], 1.0)})
    back = CostModel.from_json(json.loads(json.dumps(cm.to_json())))
    assert back.block_ms("dual", Y, 1024, 100, 64, 256) == cm.block_ms("dual", Y, 1024, 100, 64, 256)
    costs = back.block_costs(["dual", "single"], 1024, 100, 64, 256, 10**6, 2 * 10**6, [True, False], [True, True])
    assert costs[1].load_y is None and costs[0].load_kv == pytest.approx(0.2)
    assert costs[0].compute_kv < costs[0].compute_full


@pytest.mark.parametrize("threads, expected", [(1, 0.1 + 0.4), (2, 0.2), (8, 0.1)])
def test_a_load_is_priced_with_its_checksum(threads, expected):
    """A calibrated verification (one thread's hashing): the loader thread alone hashes, then copies (the sum);
    verify threads hash side by side ahead of its copies (the larger of the copy and their shared rate). A disk
    entry is verified whole on one thread. A profile without it prices the copy alone, as before."""
    load = {"mem": LinearFit([0.0, 0.1], 1.0), "disk": LinearFit([0.0, 1.0], 1.0), "verify": LinearFit([0.0, 0.4], 1.0)}
    cm = CostModel(load=load, meta={"verify_threads": threads})
    assert cm.load_ms(10**6) == pytest.approx(expected)
    assert CostModel.from_json(json.loads(json.dumps(cm.to_json()))).load_ms(10**6) == pytest.approx(expected)
    assert cm.load_ms(10**6, "disk") == pytest.approx(1.0 + 0.4)
    assert CostModel(load={"mem": load["mem"]}).load_ms(10**6) == pytest.approx(0.1)
    assert cm.load_ms(0) == 0.0


def test_flop_model_orders_the_modes():
    n, c, text, d = 1024, 205, 64, 256
    f = {m: block_flops(m, True, n, c, text, d) for m in (FULL, Y, KV, "noctx")}
    assert f[FULL] > f[Y] > f[KV] > f["noctx"]
    assert ideal_speedup([FULL] * 4, 2, n, c, text, d) == pytest.approx(1.0)
    assert ideal_speedup([KV] * 4, 2, n, n, text, d) < 1.01  # nothing cached: no gain
    assert features(FULL, n, 10, text) == features(FULL, n, n, text)
