"""The router-at-scale bench's own arithmetic: the time-compressed profile a router predicts with, the decision-time
quantiles read from the router's histograms, the counts read from its counters."""

import json

import pytest

from maskedit_common.cost_model import CostModel
from maskedit_lab import REPO_ROOT
from maskedit_lab.routing.scale import POLLS, buckets, counted, histogram_quantile
from maskedit_lab.routing.triton_emulator import scaled_profile
from maskedit_router.placement.features import EditFeatures
from maskedit_router.metrics import RouterMetrics
from maskedit_router.placement.policies import Estimator

PROFILE = REPO_ROOT / "perf_profiles" / "cost_model_bench-flux-fill.json"


def test_a_scaled_profile_predicts_every_duration_times_the_scale(tmp_path):
    scaled = CostModel.load_file(scaled_profile(PROFILE, 0.1, tmp_path / "p.json"))
    a, b = Estimator(CostModel.load_file(PROFILE)), Estimator(scaled)
    for ratio, cached in ((0.05, True), (0.3, True), (1.0, False)):
        f = EditFeatures("k", ratio, 1024, 30)
        assert b.request_ms(f, cached) == pytest.approx(0.1 * a.request_ms(f, cached))
    assert b.tier_load_ms("disk") == pytest.approx(0.1 * a.tier_load_ms("disk"))
    assert json.loads((tmp_path / "p.json").read_text())["meta"]["time_scale"] == 0.1


def test_quantiles_interpolate_within_the_histograms_buckets():
    before = {1e-4: 10.0, 1e-3: 10.0, float("inf"): 10.0}
    after = {1e-4: 60.0, 1e-3: 110.0, float("inf"): 110.0}  # 50 new below 0.1 ms, 50 between 0.1 and 1 ms
    assert histogram_quantile(before, after, 0.5) == pytest.approx(1e-4)
    assert histogram_quantile(before, after, 0.75) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert histogram_quantile(before, after, 0.25) == pytest.approx(0.5e-4)
    assert histogram_quantile(after, after, 0.5) is None  # nothing observed between them


def test_the_router_s_features_histogram_and_poll_counts_are_read_from_its_metrics_text():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    m = RouterMetrics()
    m.features_s.observe(0.0007)
    m.decision("predicted", "a:1", 0.0002)
    m.admission_polled("fast", 3)
    m.admission_polled("idle", 2)
    fams = list(text_string_to_metric_families(generate_latest(m.registry).decode()))
    feat = buckets(fams, "maskedit_router_features_seconds")
    assert feat[5e-4] == 0 and feat[1e-3] == 1 and feat[float("inf")] == 1
    assert buckets(fams, "maskedit_router_decision_seconds", policy="predicted")[2.5e-4] == 1
    assert buckets(fams, "maskedit_router_decision_seconds", policy="chwbl") == {}
    assert counted(fams, POLLS) == 5
