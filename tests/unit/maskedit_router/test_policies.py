"""Routing decisions, on the router's own bookkeeping (no server)."""

import time

import pytest

from maskedit_common.cost_model import CostModel
from maskedit_router.features import EditFeatures, mask_ratio
from maskedit_router.policies import (BackendLoad, Estimator, LeastMaskedTokens, LeastRequests, PredictedLatency,
                                      RoundRobin)
from tests.conftest import png

import numpy as np

EST = Estimator(CostModel.fallback())
F = EditFeatures("tplA", 0.2, 1024, 8)


def loads(*backlogs, templates=()):
    out = [BackendLoad(f"b{i}", backlog_ms=b, inflight=int(b // 100)) for i, b in enumerate(backlogs)]
    for i in templates:
        out[i].templates["tplA"] = time.monotonic() + 60
    return out


def test_cached_request_is_predicted_cheaper():
    assert EST.request_ms(F, cached=True) < EST.request_ms(F, cached=False) / 2


def test_affinity_wins_when_loads_are_close():
    bs = loads(300.0, 0.0, templates=[0])
    assert PredictedLatency(EST).choose(bs, F).name == "b0"


def test_load_wins_when_the_affine_backend_is_far_behind():
    bs = loads(60_000.0, 0.0, templates=[0])
    assert PredictedLatency(EST).choose(bs, F).name == "b1"


def test_hot_spot_guard_overrides_affinity():
    p = PredictedLatency(EST, abs_gate_ms=500, rel_gate=2.0)
    bs = loads(EST.request_ms(F, False) - EST.request_ms(F, True) - 1, 0.0, templates=[0])
    bs[0].backlog_ms = max(bs[0].backlog_ms, 900.0)
    chosen = p.choose(bs, F)
    assert chosen.name == "b1" or p.score(bs[0], F, time.monotonic()) < p.score(bs[1], F, time.monotonic())


def test_baselines():
    bs = loads(500.0, 100.0, 300.0)
    rr = RoundRobin()
    assert [rr.choose(bs, F).name for _ in range(4)] == ["b0", "b1", "b2", "b0"]
    assert LeastRequests().choose(bs, F).name == "b1"
    bs[1].masked_tokens = 5000
    assert LeastMaskedTokens().choose(bs, F).name in ("b0", "b2")


def test_estimator_refits_online():
    e = Estimator(CostModel.fallback())
    p = e.request_ms(F, True)
    for _ in range(50):
        e.observe(e.request_ms(F, True), 2 * p)
    assert e.request_ms(F, True) == pytest.approx(2 * p, rel=0.05)


def test_mask_ratio_from_the_encoded_mask():
    m = np.zeros((512, 512), np.uint8)
    m[:128, :] = 255  # a quarter of the rows
    ratio, tokens = mask_ratio(png(m), resolution=512)
    assert tokens == 1024 and ratio == pytest.approx(0.25)
    assert mask_ratio(png(np.zeros((64, 64), np.uint8)), 512)[0] == 0.0


def test_stale_cost_model_falls_back_to_least_masked_tokens():
    e = Estimator(CostModel.fallback())
    p = PredictedLatency(e)
    bs = [BackendLoad("b0", masked_tokens=5000, backlog_ms=0.0), BackendLoad("b1", masked_tokens=10, backlog_ms=9e5)]
    assert p.choose(bs, F).name == "b0"  # the model says b1 is far behind
    for _ in range(30):  # predictions keep being off by 10x
        e.observe(100.0, 1000.0, alpha=0.2)
        e.scale = 1.0  # (keep the fit from catching up, as with a model that no longer describes the backends)
    assert e.stale
    assert p.choose(bs, F).name == "b1"
    for _ in range(30):
        e.observe(1000.0, 1000.0, alpha=0.2)
    assert not e.stale and p.choose(bs, F).name == "b0"


def test_refit_of_a_burst_does_not_compound():
    """Twenty requests routed at scale 1 all take twice their prediction: the fit converges to 2, however many
    complete after it has already moved (the ratio is taken against the scale each was predicted with)."""
    e = Estimator(CostModel.fallback())
    p = e.request_ms(F, True)  # predicted at scale 1, before any completion
    for _ in range(20):
        e.observe(p, 2 * p, predicted_scale=1.0, alpha=0.3)
    assert e.scale == pytest.approx(2.0, rel=0.01)


def test_a_hit_is_never_predicted_dearer_than_a_miss_even_past_the_calibrated_sizes():
    """A profile whose full-block fit is one calibrated size (a constant) extrapolated the KV fit past it and
    predicted a hit at 4096 tokens above a miss: affinity then sent every repeat of a template elsewhere."""
    from maskedit_common.cost_model import LinearFit

    const, slope = LinearFit([16.0, 0.0, 0.0, 0.0], 1.0), LinearFit([1.0, 7.0, 0.0, 8.0], 1.0)
    est = Estimator(CostModel(compute={k: {"full": const, "kv": slope} for k in ("dual", "single")}))
    big = EditFeatures("tplA", 0.2, 4096, 2)
    assert est.request_ms(big, cached=True) <= est.request_ms(big, cached=False)
    bs = loads(0.0, 0.0, templates=[1])  # equal predictions: the backend holding the template keeps it
    assert PredictedLatency(est).choose(bs, big).name == "b1"


def test_the_routers_default_profile_predicts_a_hit_cheaper_on_its_own_token_grid():
    from maskedit_router.__main__ import build

    router = build(["10.0.0.1:8001"])
    assert router.resolution == router.est.cost.meta["resolution"]  # masks measured on the profiled grid
    ratio, n = mask_ratio(png(np.pad(np.full((51, 256), 255, np.uint8), ((0, 205), (0, 0)))), router.resolution)
    f = EditFeatures("tplA", ratio, n, 8)
    assert router.est.request_ms(f, cached=True) < 0.7 * router.est.request_ms(f, cached=False)
    for b in router.backends.values():
        b.close()


def test_a_profiles_blocks_set_what_the_estimator_sums():
    """A UNet's blocks per level (tokens relative to the router's 16-px grid, both guidance rows): the prediction
    sums each run's blocks at its own token count."""
    meta = {"blocks": [["unet-l1", 2, 512, 64], ["unet-l2", 4, 128, 128]], "grid_tokens": 256, "text": 154}
    est = Estimator(CostModel(meta=meta, fallback_flops_per_ms=2e7))
    assert est.blocks == [("unet-l1", 2, 2.0, 64), ("unet-l2", 4, 0.5, 128)] and est.text == 154
    f = EditFeatures("t", 0.25, 256, 1)
    want = 2 * est.cost.block_ms("unet-l1", "full", 512, 512, 154, 64) + \
        4 * est.cost.block_ms("unet-l2", "full", 128, 128, 154, 128)
    assert est.request_ms(f, cached=False) == pytest.approx(want)
    assert est.request_ms(f, cached=True) < want


def test_the_router_finds_the_served_models_profile_as_the_backends_do(tmp_path, monkeypatch):
    from maskedit_router.__main__ import default_profile

    monkeypatch.setenv("MASKEDIT_PROFILES_DIR", str(tmp_path))
    monkeypatch.setenv("MASKEDIT_MODEL_DIR", str(tmp_path / "models" / "my-model"))
    monkeypatch.delenv("MASKEDIT_COST_PROFILE", raising=False)
    assert default_profile().name == "cost_model_bench-flux-fill.json"  # nothing of its own: the shipped one
    (tmp_path / "cost_model_my-model.json").write_text("{}")
    assert default_profile() == tmp_path / "cost_model_my-model.json"
    (tmp_path / "cost_model_my-model_h100.json").write_text("{}")
    assert default_profile() == tmp_path / "cost_model_my-model_h100.json"  # a GPU's before the CPU's
    monkeypatch.setenv("MASKEDIT_COST_PROFILE", str(tmp_path / "x.json"))
    assert default_profile() == tmp_path / "x.json"
