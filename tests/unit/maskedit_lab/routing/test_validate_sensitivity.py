"""`make router-sensitivity`: a measured run replayed as the validation's headline, its host slowed or made noisy,
and what the run's own host record says of its speed."""

import json

import numpy as np
import pytest

from maskedit_lab.routing import validate_sensitivity as vs
from maskedit_lab.routing.validate_replay import HEADLINE, compare, headline_replay


def _measured(requests=10, gap_s=30.0):
    calib = {"hit_scale": 1.0, "miss_scale": 1.0, "outside_s": 0.2, "interference": 0.0, "points": []}
    after = {**calib, "hit_scale": 1.4}
    req = lambda t: {"t": t, "template": 1, "mask_ratio": 0.2, "tokens": 1024, "latency_s": 1.0,  # noqa: E731
                     "queue_s": 0.0, "denoise_s": 0.9, "cache_hit": True, "error": None, "computed_tokens": 100}
    warm = [{"template": 1, "mask_ratio": 0.2, "tokens": 1024}]
    run_ = {"policy": "round_robin", "load": 0.5, "rate": 0.5, "warmup": warm, "calibration": calib,
            "requests": [req(gap_s * i) for i in range(requests)]}
    meta = {"policy": "round_robin", "instances": 2, "host_cores": 2, "steps": 8, "calibration": calib,
            "profile": "missing-profile.json", "final_calibration": after}
    return {"meta": meta, "runs": [run_]}


def test_the_headline_replay_is_the_validations_headline_and_a_slower_host_stretches_it():
    m = _measured()
    lat, cpu = headline_replay(m, 0)
    row, = [r for r in compare(m) if r["model"] == HEADLINE]
    assert float(np.percentile(lat, 95)) == pytest.approx(row["p95_s"])
    # isolated requests: every part of their latency is CPU work on the host, all of it slowed alike
    slow, slow_cpu = headline_replay(m, 0, slowdown=1.5)
    assert slow == pytest.approx(1.5 * lat)
    assert slow_cpu["denoise"] == pytest.approx(1.5 * cpu["denoise"]) and set(cpu) >= {"denoise", "pre", "post"}
    assert np.array_equal(headline_replay(m, 0, slowdown=1.0)[0], lat)


def test_noise_on_the_hosts_tasks_is_seeded_and_leaves_the_mean_about_where_it_was():
    m = _measured(requests=60)
    base = headline_replay(m, 0)[0]
    a, b = (headline_replay(m, 0, noise_cv=0.3, noise_seed=s)[0] for s in (0, 1))
    assert np.array_equal(a, headline_replay(m, 0, noise_cv=0.3, noise_seed=0)[0])
    assert not np.array_equal(a, b) and a.std() > 0
    assert a.mean() == pytest.approx(base.mean(), rel=0.1)


def test_the_matching_slowdown_is_read_between_the_factors_that_bracket_the_measurement():
    assert vs.matching_slowdown([0.9, 1.0, 1.2], [8.0, 10.0, 20.0], 15.0) == pytest.approx(1.1)
    assert vs.matching_slowdown([0.9, 1.0, 1.2], [8.0, 10.0, 20.0], 8.0) == pytest.approx(0.9)
    assert vs.matching_slowdown([0.9, 1.0, 1.2], [8.0, 10.0, 20.0], 25.0) is None


def test_a_runs_denoise_cpu_is_counted_per_thousand_token_steps_it_computed():
    meta = {"steps": 8}
    samples = [{"t": float(t), "by_model": {vs.DENOISE: 1.0, "preprocess": 0.5}} for t in range(1, 11)]
    run_ = {"host": samples, "requests": [
        {"cache_hit": True, "computed_tokens": 100, "tokens": 1024, "error": None},  # a hit: what it computed
        {"cache_hit": False, "computed_tokens": None, "tokens": 1024, "error": None},  # a template run: all
        {"cache_hit": False, "computed_tokens": None, "tokens": 1024, "error": "UNAVAILABLE"}]}  # unanswered
    assert vs.denoise_cpu_per_ktoken_step(meta, run_) == pytest.approx(1e6 * 10.0 / ((100 + 1024) * 8))
    assert vs.denoise_cpu_per_ktoken_step(meta, {**run_, "host": []}) is None
    older = [{"t": s["t"], "foreign_cores": 0.1} for s in samples]  # recorded before by_model
    assert vs.denoise_cpu_per_ktoken_step(meta, {**run_, "host": older}) is None


def test_a_runs_own_speed_is_the_slowdown_whose_replay_uses_the_denoise_cpu_the_run_used():
    m = _measured()
    _, cpu = headline_replay(m, 0, slowdown=1.3)
    used_s = (cpu["denoise"] + cpu.get("write", 0.0)) / 1000
    span = m["runs"][0]["requests"][-1]["t"] + 60.0
    # the run's record: its denoise process busy at that CPU's rate over the run
    m["runs"][0]["host"] = [{"t": float(t), "by_model": {vs.DENOISE: used_s / span}, "foreign_cores": 0.0}
                            for t in range(1, int(span) + 1)]
    assert vs.run_speed(m, 0) == pytest.approx(1.3, abs=0.01)
    row, = vs.sensitivity(m, factors=(1.0, 1.05), noise_cvs=(), seeds=1)["rows"]
    assert row["run_speed"]["slowdown"] == pytest.approx(1.3, abs=0.01)
    assert row["run_speed"]["p95_s"] == pytest.approx(float(np.percentile(headline_replay(m, 0, slowdown=1.3)[0], 95)),
                                                      rel=0.02)
    del m["runs"][0]["host"]
    assert vs.run_speed(m, 0) is None  # no record of the run's CPU: no speed of its own


def test_the_replays_at_the_calibrated_and_the_runs_own_speed_are_ranked_as_the_validation_ranks():
    m = _measured()
    m["runs"].append({**m["runs"][0], "policy": "least_requests"})
    got = vs.sensitivity(m, factors=(1.0, 1.05), noise_cvs=(), seeds=1)["ranking"]
    assert [(r["model"], r["load"], sorted(r["measured"])) for r in got] == \
        [("calibrated", 0.5, ["least_requests", "round_robin"])]  # no host record: no run-speed replay to rank


def test_a_file_is_replayed_into_json_and_a_plot(tmp_path):
    src = tmp_path / "v.json"
    src.write_text(json.dumps(_measured()))
    vs.main(["--from", str(src), "--factors", "1.0", "1.05", "1.5", "--noise-cv", "0.2", "--seeds", "2"])
    out = tmp_path / "v_sensitivity.json"
    result = json.loads(out.read_text())
    row, = result["rows"]
    assert list(row["simulated_p95_s"]) == ["1.0", "1.05", "1.5"]
    p = list(row["simulated_p95_s"].values())
    assert p[0] < p[1] < p[2] and row["p95_elasticity"] == pytest.approx(1.0, abs=0.01)  # isolated: linear
    assert set(row["noise_p95_s"]) == {"0.2"} and row["noise_seeds"] == 2
    assert result["ranking"] == []  # one policy: no pair to order
    assert result["meta"]["source"] == "v.json" and result["meta"]["calibrations"]["count"] == 3  # the file's, the run's, the final one
    assert out.with_suffix(".png").stat().st_size > 0
