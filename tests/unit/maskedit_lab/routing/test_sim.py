"""The router simulator's worker model: step-level batching, template caching, CPU hosts shared by processor
sharing with single-instance pre/post-processing queues."""

import numpy as np
import pytest

from maskedit_common.cost_model import CostModel
from maskedit_lab.routing.sim_cluster import HostModel, replay
from maskedit_router.placement.features import EditFeatures
from maskedit_router.placement.policies import Estimator


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


def test_requests_on_a_template_being_recorded_follow_the_run(est):
    """As the engine: a request joining a template run in progress is a hit; one admitted with it is not."""
    run, follower = replay("round_robin", 1, [(0.0, f()), (0.01, f())], est)["requests"]
    assert follower.started > run.started
    assert follower.step_ms == pytest.approx(est.request_ms(f(), True) / f().steps)  # its own share of a step
    assert run.step_ms == pytest.approx(est.request_ms(f(), False) / f().steps)
    # both wait for the step of a request on another template to end, then join together
    _, *level = replay("round_robin", 1, [(0.0, f("b")), (0.001, f()), (0.002, f())], est)["requests"]
    assert level[0].started == level[1].started and level[1].step_ms == pytest.approx(run.step_ms)


def test_hits_recompute_the_template_runs_edit_until_a_hit_heals_it(est):
    """As the engine: a template run's own edit is invalid in its entry; a hit computes its mask and those tokens;
    a hit on the stored entry that leaves them unmasked heals them when it completes."""
    import numpy as np

    n = 1024
    left, right = np.zeros(n, bool), np.zeros(n, bool)
    left[:200], right[-100:] = True, True
    arr = [(0.0, f(ratio=left.mean())), (0.01, f(ratio=right.mean())),  # follows the run: no heal (not stored)
           (100.0, f(ratio=right.mean())), (200.0, f(ratio=right.mean()))]
    run, follower, healer, after = replay("round_robin", 1, arr, est, masks=[left, right, right, right])["requests"]
    union = f(ratio=(left | right).mean())
    assert follower.step_ms == pytest.approx(est.request_ms(union, True) / 4) and not follower.heals
    assert healer.step_ms == follower.step_ms and healer.heals
    assert after.step_ms == pytest.approx(est.request_ms(f(ratio=right.mean()), True) / 4) and not after.heals
    # without masks every entry is clean
    plain = replay("round_robin", 1, arr, est)["requests"]
    assert plain[2].step_ms == pytest.approx(after.step_ms)
    # a heal smaller than the threshold is not made
    _, _, small, _ = replay("round_robin", 1, arr, est, masks=[left, right, right, right],
                            heal_min_ratio=0.5)["requests"]
    assert not small.heals


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


def test_loops_on_busy_cores_slow_each_other_by_the_interference(est):
    arr = [(0.0, f("a")), (0.0, f("b"))]
    alone = latency(replay("round_robin", 1, arr[:1], est, host=HostModel(2, 1, 0.0, 0.0, interference=0.3))
                    ["requests"][0])
    assert alone == pytest.approx(latency(replay("round_robin", 1, arr[:1], est)["requests"][0]))  # one core busy
    both = replay("round_robin", 2, arr, est, host=HostModel(2, 2, 0.0, 0.0, interference=0.3))["requests"]
    for q in both:  # two cores busy: each 1.3x slower, though neither waits for a core
        assert latency(q) == pytest.approx(1.3 * alone)
    crowded = replay("round_robin", 2, arr, est, host=HostModel(1, 2, 0.0, 0.0, interference=0.3))["requests"]
    for q in crowded:  # one core: sharing it, no second core to interfere
        assert latency(q) == pytest.approx(2 * alone)


def test_a_host_counts_the_cpu_its_tasks_were_given_as_a_process_clock_would(est):
    arr = [(0.0, f("a")), (0.0, f("b"))]
    alone = replay("round_robin", 1, arr[:1], est, host=HostModel(2, 1, 0.0, 0.0))
    work = alone["cpu_ms"]["denoise"]
    assert work == pytest.approx(1000 * latency(alone["requests"][0]))  # alone on a core: CPU time = wall time
    shared = replay("round_robin", 2, arr, est, host=HostModel(1, 2, 0.0, 0.0))  # one core: half each, twice as long
    assert shared["cpu_ms"]["denoise"] == pytest.approx(2 * work)
    busy = replay("round_robin", 2, arr, est, host=HostModel(2, 2, 0.0, 0.0, interference=0.3))
    assert busy["cpu_ms"]["denoise"] == pytest.approx(2 * 1.3 * work)  # interfering: on the core 1.3x as long
    early = replay("round_robin", 1, [(-100.0, f("a"))], est, host=HostModel(2, 1, 0.0, 0.0))
    assert early["cpu_ms"].get("denoise", 0.0) == 0.0  # before time 0 (a replay's lead): not the run's


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


def test_saturation_throughput_leaves_out_fill_and_drain():
    from maskedit_lab.routing.validate_replay import saturation_throughput

    # 8 completions: a slow start, one per second in the middle, a long drain
    done = [5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 30.0, 60.0]
    assert saturation_throughput(done) == pytest.approx(3 / 3.0)  # 3rd..6th completion: 3 in 3 s


def test_validation_replays_burst_and_runs_with_their_own_calibration():
    from maskedit_lab.routing.validate_replay import compare

    calib = {"hit_scale": 1.0, "miss_scale": 1.0, "outside_s": 0.1}
    req = lambda t, tpl: {"t": t, "template": tpl, "mask_ratio": 0.2, "tokens": 1024}  # noqa: E731
    warm = [{"template": 1, "mask_ratio": 0.2, "tokens": 1024}]
    measured = {
        "meta": {"policy": "round_robin", "instances": 2, "host_cores": 2, "steps": 8, "calibration": calib,
                 "profile": "missing-profile.json",
                 "saturation": {"throughput": 1.0, "calibration": calib, "warmup": warm,
                                "requests": [req(0.0, 1) for _ in range(12)]}},
        "runs": [{"load": 0.5, "rate": 0.5, "warmup": warm, "calibration": {**calib, "hit_scale": 2.0},
                  "requests": [{**req(30.0 * i, 1), "latency_s": 1.0, "queue_s": 0.0, "denoise_s": 0.9,
                                "cache_hit": True, "error": None} for i in range(10)]}],
    }
    rows = compare(measured)
    sat = [r for r in rows if r["load"] == "saturation"]
    assert [r["model"] for r in sat] == ["measured", "plain", "shared_cpu"]
    assert all(r["throughput"] > 0 for r in sat)
    runs = {r["model"]: r for r in rows if r["load"] == 0.5}
    assert set(runs) == {"measured", "plain", "shared_cpu", "shared_cpu_pooled"}
    # the run's own calibration (hits twice the profile) is used, not the burst's: isolated hits take 2x
    est = Estimator(CostModel.fallback())
    alone = 2.0 * est.request_ms(EditFeatures("t1", 0.2, 1024, 8), True) / 1000 + 8 * 2.0 / 1000 + 0.1
    assert runs["plain"]["p50_s"] == pytest.approx(alone, rel=1e-6)


def test_validation_brackets_each_run_with_the_calibration_after_it():
    from maskedit_lab.routing.validate_replay import bracketed, compare

    before = {"hit_scale": 1.0, "miss_scale": 1.0, "outside_s": 0.1, "interference": 0.0, "points": []}
    after = {"hit_scale": 3.0, "miss_scale": 2.0, "outside_s": 0.3, "interference": 0.1, "points": []}
    mid = bracketed(before, after)
    assert (mid["hit_scale"], mid["miss_scale"], mid["outside_s"], mid["interference"]) == \
        pytest.approx((2.0, 1.5, 0.2, 0.05))
    req = lambda t: {"t": t, "template": 1, "mask_ratio": 0.2, "tokens": 1024, "latency_s": 1.0,  # noqa: E731
                     "queue_s": 0.0, "denoise_s": 0.9, "cache_hit": True, "error": None}
    warm = [{"template": 1, "mask_ratio": 0.2, "tokens": 1024}]
    run_ = lambda load, calib: {"load": load, "rate": 0.5, "warmup": warm, "calibration": calib,  # noqa: E731
                                "requests": [req(30.0 * i) for i in range(10)]}
    meta = {"policy": "round_robin", "instances": 2, "host_cores": 2, "steps": 8, "calibration": before,
            "profile": "missing-profile.json"}
    rows = compare({"meta": {**meta, "final_calibration": after}, "runs": [run_(0.5, before), run_(0.7, after)]})
    models = lambda load: {r["model"]: r for r in rows if r["load"] == load}  # noqa: E731
    first, last = models(0.5), models(0.7)
    # the first run is bracketed by the second's calibration, the last by the final one
    assert set(first) == set(last) == {"measured", "plain", "shared_cpu", "shared_cpu_calibrated_after",
                                       "shared_cpu_bracketed", "shared_cpu_pooled"}
    # isolated hits: latency grows with the hit scale, so the bracket's mean lies between its ends
    assert first["shared_cpu"]["p50_s"] < first["shared_cpu_bracketed"]["p50_s"] < \
        first["shared_cpu_calibrated_after"]["p50_s"]
    assert last["shared_cpu"]["p50_s"] == pytest.approx(last["shared_cpu_calibrated_after"]["p50_s"])
    older = compare({"meta": meta, "runs": [run_(0.5, before)]})  # no calibration after the last run
    assert {r["model"] for r in older} == {"measured", "plain", "shared_cpu", "shared_cpu_pooled"}
    # a run with the host's samples: the headline again with its foreign CPU, which only slows it
    busy = {**run_(0.5, before), "host": [{"t": float(t), "foreign_cores": 2.0, "tested_cores": 1.0}
                                         for t in range(1, 400)]}
    with_host = {r["model"]: r for r in compare({"meta": {**meta, "final_calibration": after}, "runs": [busy]})
                 if r["load"] == 0.5}
    assert with_host["shared_cpu_bracketed_host_load"]["p50_s"] > with_host["shared_cpu_bracketed"]["p50_s"]


def test_the_pooled_calibration_takes_every_calibrations_probes_and_the_median_of_the_rest():
    from maskedit_lab.routing.validate_replay import calibrations, pooled

    def calib(scale, outside):
        return {"hit_scale": scale, "miss_scale": scale, "outside_s": outside, "points": [{"denoise_s": scale}]}

    a, b, c, final = calib(1.0, 0.1), calib(2.0, 0.2), calib(4.0, 0.6), calib(3.0, 0.3)
    measured = {"meta": {"calibration": a, "saturation": {"calibration": a}, "final_calibration": final},
                "runs": [{"calibration": b}, {"calibration": b, "calibration_shared": True}, {"calibration": c}]}
    got = calibrations(measured)
    assert got == [a, b, c, final] and got[0] is a  # each once, in the order taken
    p = pooled(got)
    assert p["points"] == [{"denoise_s": s} for s in (1.0, 2.0, 4.0, 3.0)]
    assert (p["hit_scale"], p["outside_s"]) == pytest.approx((2.5, 0.25))  # medians of four
    assert "interference" not in p  # a figure no calibration has stays absent


def test_the_worst_window_counts_the_tokens_its_hits_computed_measured_and_simulated():
    from types import SimpleNamespace

    from maskedit_lab.routing.validate_replay import worst_window

    reqs = [{"t": float(k), "error": None, "denoise_s": 1.0, "cache_hit": k % 2 == 0, "computed_tokens": 300,
             "mask_ratio": 0.1, "tokens": 1000} for k in range(10)]
    sim = [SimpleNamespace(started=0.0, denoised=1.0, computed=200) for _ in reqs]
    w = worst_window({"requests": reqs}, sim)
    # five hits: their masks hold 100 tokens each, the real entry's invalid ones took them to 300, the replay's 200
    assert (w["hit_tokens_masked"], w["hit_tokens_measured"], w["hit_tokens_simulated"]) == (500, 1500, 1000)
    assert "steps_cpu_share" not in w  # files from before EDIT_INFO carried the steps' CPU time


def test_the_worst_window_says_how_much_of_its_steps_wall_time_the_denoise_loop_ran():
    from types import SimpleNamespace

    from maskedit_lab.routing.validate_replay import worst_window

    # 20 requests over two windows; the second's steps took twice as long on the wall for the same CPU
    reqs = [{"t": float(k), "error": None, "denoise_s": 2.0 if k >= 15 else 1.0, "steps_cpu_s": 0.9,
             "steps_wall_s": 2.0 if k >= 15 else 1.0} for k in range(30)]
    sim = [SimpleNamespace(started=0.0, denoised=1.0, computed=None) for _ in reqs]
    w = worst_window({"requests": reqs}, sim)
    assert w["t0_s"] == 15.0 and w["steps_cpu_share"] == 0.45 and w["run_steps_cpu_share"] == 0.6


def test_a_replayed_request_says_which_tokens_it_computed(est):
    from maskedit_common.heal import computed_tokens

    mask = np.zeros(1024, bool)
    mask[:100] = True
    other = np.zeros(1024, bool)
    other[500:520] = True
    arr = [(0.0, f("t", 100 / 1024)), (100.0, f("t", 20 / 1024))]
    miss, hit = replay("round_robin", 1, arr, est, masks=[mask, other])["requests"]
    assert miss.records and miss.computed == 1024  # a template run computes every token
    # a hit computes its own mask and the entry's invalid tokens (the template run's edit), by the engine's rule
    assert hit.cached and hit.computed == int(computed_tokens(other, mask).sum()) == 120


def test_a_saved_calibration_is_replayed_against_the_profile_it_was_taken_with():
    """Speed ratios are relative to a profile: a replay with another profile derives them again from the probes'
    measured denoise times (the bench profile was recalibrated after a saved run, whose x1.8 then made the
    replay 4-5x slow), and a measurement that embeds its profile is replayed with that profile."""
    from maskedit_lab.routing.validate_replay import profile_scales, replay_cost

    est = Estimator(CostModel.fallback())
    f = lambda r: EditFeatures("c", r, 1024, 8)  # noqa: E731
    # probes that took 3x the fallback profile's prediction, saved with ratios against an older profile (x1.5)
    points = [{"mask_ratio": 1.0, "hit": False, "denoise_s": 3 * est.request_ms(f(1.0), False) / 1000},
              {"mask_ratio": 0.1, "hit": True, "denoise_s": 3 * est.request_ms(f(0.1), True) / 1000},
              {"mask_ratio": 0.3, "hit": True, "denoise_s": 3 * est.request_ms(f(0.3), True) / 1000}]
    calib = profile_scales({"hit_scale": 1.5, "miss_scale": 1.5, "points": points}, est, 1024, 8)
    assert calib["hit_scale"] == pytest.approx(3.0) and calib["miss_scale"] == pytest.approx(3.0)
    assert calib["profile_factor"] == pytest.approx(2.0)  # converts the router's online fit the same way
    assert profile_scales({"hit_scale": 1.5, "miss_scale": 1.5}, est, 1024, 8)["hit_scale"] == 1.5  # no probes
    doc = {"compute": {}, "load": {}, "meta": {"blocks": [["dual", 2, 64, 128]], "grid_tokens": 64}}
    assert replay_cost({"profile": "missing.json", "profile_doc": doc}).meta["grid_tokens"] == 64


def test_validation_replays_each_run_with_its_own_policy():
    from maskedit_lab.routing.validate_replay import compare

    calib = {"hit_scale": 1.0, "miss_scale": 1.0, "outside_s": 0.1}
    req = lambda t: {"t": t, "template": 1, "mask_ratio": 0.2, "tokens": 1024, "latency_s": 1.0,  # noqa: E731
                     "queue_s": 0.0, "denoise_s": 0.9, "cache_hit": True, "error": None}
    warm = [{"template": 1, "mask_ratio": 0.2, "tokens": 1024}]
    runs = [{"policy": p, "load": 0.7, "rate": 0.5, "warmup": warm, "calibration": calib,
             "requests": [req(30.0 * i) for i in range(10)]} for p in ("chwbl", "p2c")]
    meta = {"policy": "chwbl", "instances": 2, "host_cores": 2, "steps": 8, "calibration": calib,
            "profile": "missing-profile.json"}
    rows = compare({"meta": meta, "runs": runs})
    assert {(r["policy"], r["model"]) for r in rows if r["model"] in ("measured", "shared_cpu")} == \
        {(p, m) for p in ("chwbl", "p2c") for m in ("measured", "shared_cpu")}


def test_validation_reads_saved_token_masks():
    import numpy as np

    from maskedit_lab.routing.validate_replay import _replayed

    t = np.zeros(1024, bool)
    t[[0, 5, 1023]] = True
    r = {"t": 0.0, "template": 1, "mask_ratio": 3 / 1024, "tokens": 1024, "mask_bits": np.packbits(t).tobytes().hex()}
    _, (back,), _, _ = _replayed({"steps": 8}, {"warmup": [], "requests": [r]}, "0")
    assert back.dtype == bool and (back == t).all()
    older = {"warmup": [{"template": 1, "mask_ratio": 0.1, "tokens": 1024}], "requests": [{**r, "mask_bits": None}]}
    del older["requests"][0]["mask_bits"]
    assert _replayed({"steps": 8}, older, "0")[1] is None  # older files: no masks


def _bench_estimator():
    from maskedit_lab import REPO_ROOT

    return Estimator(CostModel.load_file(REPO_ROOT / "perf_profiles" / "cost_model_bench-flux-fill.json"))


def test_a_batch_of_cached_requests_pays_each_blocks_fixed_cost_once():
    """The engine packs a step's requests into one transformer call: the constant of each block's kv fit (kernel
    launches, weight reads) is paid once per step, not per request (before: the sum of the requests' own steps,
    which made a busy worker 10-20 % slower than measured)."""
    from maskedit_lab.routing.sim_cluster import batch_shared_ms

    est = _bench_estimator()
    shared = batch_shared_ms(est)
    fixed = sum(count * est.cost.compute[kind]["kv"].coef[0] for kind, count, _, _ in est.blocks)
    assert shared == pytest.approx(fixed) and shared > 0
    assert batch_shared_ms(Estimator(CostModel.fallback())) == 0.0  # FLOP-proportional: no fixed part
    warm = [(0.0, f("a")), (0.0, f("b"))]
    # two hits that wait out another request's one step, then run together
    arr = warm + [(100.0, f("z", steps=1)), (100.001, f("a")), (100.001, f("b"))]
    *_, x, y = replay("round_robin", 1, arr, est)["requests"]
    alone = est.request_ms(f("a"), True) / 4
    assert x.started == y.started
    steps = 4 * (2.0 + 2 * alone - shared) / 1000  # both hits' steps, the shared part once
    assert x.denoised - x.started == pytest.approx(steps)
    *_, x0, _ = replay("round_robin", 1, arr, est, batch_shared=0.0)["requests"]
    assert x0.denoised - x0.started == pytest.approx(steps + 4 * shared / 1000)  # the old sum


def test_validation_replays_the_calibration_probes_that_went_through_the_router():
    """Between a run's warm-up and its requests the calibration sent 7 edits through the router: a replay sends
    them too, so round_robin starts the run on the backend the real one did (before, its turn was off by the probes,
    and the replay's round_robin placed every request on the other instance)."""
    from maskedit_lab.routing.validate_replay import _replayed

    points = [{"mask_ratio": 1.0, "hit": False, "tokens": 1024}] + \
        [{"mask_ratio": r, "hit": True, "tokens": 1024} for r in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)]
    warm = [{"template": t, "mask_ratio": 0.1, "tokens": 1024} for t in (1, 2)]
    run_ = {"warmup": warm, "calibration": {"points": points, "key": "k"},
            "requests": [{"t": 0.0, "template": 1, "mask_ratio": 0.1, "tokens": 1024}]}
    arrivals, _, n_lead, routes = _replayed({"steps": 8}, run_, "0")
    assert n_lead == 9 and routes is None
    assert [f.template_key for _, f in arrivals] == ["t1", "t2"] + ["k"] * 7 + ["t1"]
    assert arrivals[2][1].mask_ratio == 0.0  # the registration's empty mask
    assert all(t < 0 for t, _ in arrivals[:n_lead]) and arrivals[-1][0] == 0.0
    est = Estimator(CostModel.fallback())
    out = replay("round_robin", 2, arrivals, est, names=["a:1", "b:2"])["requests"]
    sat = _replayed({"steps": 8}, {**run_, "warmup": warm}, "saturation")[0]
    assert [f.template_key for _, f in sat][:2] == ["k", "k"]  # the burst's calibration came before its warm-up
    assert out[-1].f.template_key == "t1"
    # a run that shared an earlier run's calibration sent no probes of its own
    assert _replayed({"steps": 8}, {**run_, "calibration_shared": True}, "0")[2] == 2


def test_measured_routing_replays_each_request_where_the_router_sent_it():
    from maskedit_lab.routing.validate_replay import MeasuredRouting, _replayed, compare, ranking

    calib = {"hit_scale": 1.0, "miss_scale": 1.0, "outside_s": 0.1, "instances": ["vm:1", "vm:2"],
             "points": [{"mask_ratio": 1.0, "hit": False, "tokens": 1024, "instance": "vm:2", "denoise_s": 1.0}]}
    req = lambda t, inst, lat: {"t": t, "template": 1, "mask_ratio": 0.2, "tokens": 1024, "latency_s": lat,  # noqa: E731
                                "queue_s": 0.0, "denoise_s": 0.9, "cache_hit": True, "error": None, "instance": inst}
    warm = [{"template": 1, "mask_ratio": 0.2, "tokens": 1024, "instance": "vm:1"}]
    runs = [{"policy": p, "load": 0.7, "rate": 0.5, "warmup": warm, "calibration": calib,
             "requests": [req(30.0 * i, "vm:2" if i % 3 else "vm:1", lat) for i in range(10)]}
            for p, lat in (("chwbl", 1.0), ("p2c", 2.0))]
    meta = {"policy": "chwbl", "instances": 2, "host_cores": 2, "steps": 8, "calibration": calib,
            "profile": "missing-profile.json", "final_calibration": calib}
    _, _, _, routes = _replayed(meta, runs[0], "0")
    assert routes == [0, 1] + [0 if i % 3 == 0 else 1 for i in range(10)]
    policy = MeasuredRouting(routes)
    assert [policy.choose(["w0", "w1"], None) for _ in routes] == ["w" + str(r) for r in routes]
    rows = compare({"meta": meta, "runs": runs})
    fixed = [r for r in rows if r["model"] == "shared_cpu_bracketed_measured_routing"]
    assert len(fixed) == 2 and all(r["requests"] == 10 and "mean_error" in r for r in fixed)
    (order,) = ranking(rows)
    assert order["measured"] == ["chwbl", "p2c"] and order["kendall_tau"] in (-1.0, 1.0)
    assert order["same_order"] == (order["kendall_tau"] == 1.0)


def test_simulated_router_refits_its_own_copy(est):
    arrivals = [(i * 0.5, f(template=f"t{i % 3}")) for i in range(20)]
    a = replay("predicted", 2, arrivals, est)
    b = replay("predicted", 2, arrivals, est)
    assert est.scale == 1.0 and est.observations == 0  # the caller's estimator is untouched
    assert [q.done for q in a["requests"]] == [q.done for q in b["requests"]]


def test_an_entry_write_takes_its_cpu_from_the_requests_running_beside_it(est):
    """A template run's entry is written in the background as it finishes: on a one-core host the hit that runs
    meanwhile loses exactly that CPU (processor sharing is work-conserving)."""
    host = HostModel(cores=1, workers_per_host=1, pre_ms=0.0, post_ms=0.0)
    (run,) = replay("round_robin", 1, [(0.0, f())], est, host=host)["requests"]
    arr = [(0.0, f()), (run.denoised, f(ratio=0.5))]  # the hit arrives as the template run leaves the batch
    quiet = replay("round_robin", 1, arr, est, host=host)["requests"]
    busy = replay("round_robin", 1, arr, est, host=HostModel(1, 1, 0.0, 0.0, record_ms=50.0))["requests"]
    assert quiet[1].records is False and busy[0].records is True
    assert latency(busy[1]) == pytest.approx(latency(quiet[1]) + 0.05)
    assert latency(busy[0]) == pytest.approx(latency(quiet[0]))  # the write does not delay the run's own reply


def test_adapters_load_cold_once_per_worker_and_affinity_keeps_them_where_they_are(est):
    """A named adapter costs ``lora_load_ms`` the first time it runs on a worker, not after; routing that knows
    adapters (``predicted``, ``weighted``) loads fewer of them cluster-wide than round robin on the same arrivals."""
    e = Estimator(CostModel.fallback(), lora_load_ms=500.0)
    one = [(0.0, EditFeatures("a", 0.2, 1024, 4, loras=1, adapters=("L",))),
           (100.0, EditFeatures("a", 0.2, 1024, 4, loras=1, adapters=("L",)))]
    out = replay("round_robin", 1, one, e)
    first, second = out["requests"]
    assert out["adapter_loads"] == 1 and latency(first) - latency(second) > 0.5
    # eight adapters drawn at random over four workers, each request its own template (no template affinity),
    # spaced so little queues (a request is ~7 s): round robin loads each adapter nearly everywhere
    rng = np.random.default_rng(0)
    arrivals = [(i * 8.0, EditFeatures(f"u{i}", 0.2, 1024, 4, loras=1, adapters=(f"L{rng.integers(8)}",)))
                for i in range(96)]
    loads = {p: replay(p, 4, arrivals, e)["adapter_loads"] for p in ("round_robin", "predicted", "weighted")}
    assert loads["predicted"] < loads["round_robin"] / 2 and loads["weighted"] < loads["round_robin"] / 2, loads


def test_a_replay_starts_from_the_entries_its_instances_already_held(est):
    """A template registered on a worker before the replay (``held``) is a hit from the first request; without it
    the same request is a template run (the negative control)."""
    cold, = replay("round_robin", 1, [(0.0, f("x"))], est, names=["w0"])["requests"]
    warm, = replay("round_robin", 1, [(0.0, f("x"))], est, names=["w0"], held={"w0": ["x"]})["requests"]
    assert cold.records and not cold.cached
    assert warm.cached and not warm.records and latency(warm) < latency(cold)
    other, = replay("round_robin", 2, [(0.0, f("x"))], est, names=["w0", "w1"], held={"w1": ["x"]},
                    policy_kw=None)["requests"]  # round_robin sends it to w0, which does not hold it
    assert other.records


def test_validation_replays_the_templates_its_probes_had_registered():
    """The harness numbered the j-th calibration's probe template 900 + j (through the router) and its interference
    template 1900 + j (on both instances directly), and a run's "fresh" templates (template + 100 * k) collided with
    them: in router_validation.json p2c at 0.85 (templates 900-903) and least_masked_tokens at 0.5 (1900-1903)
    found every template stored, where a replay from empty stores simulated four template runs."""
    from maskedit_lab.routing.validate_replay import held_before

    calib = lambda inst: {"instances": ["vm:1", "vm:2"], "points": [{"instance": inst}]}  # noqa: E731
    run_ = lambda templates, c: {"warmup": [], "calibration": c,  # noqa: E731
                                 "requests": [{"template": t, "key": f"k{t}"} for t in templates]}
    meta = {"instances": 2, "backends": ["a:1", "b:2"], "saturation": {"calibration": calib("vm:2")}}
    runs = [run_([100, 101], calib("vm:1")), run_([900, 901, 1901, 1902, 5], calib("vm:1")),
            run_([902], calib("vm:1"))]
    assert held_before(meta, runs, 0) == {}  # no collision: stores start empty as before
    # calibration 0 (the burst's) ran on vm:2, 1 and 2 (runs 0 and 1) on vm:1; interference templates on both
    assert held_before(meta, runs, 1) == {"a:1": ["k901", "k1901", "k1902"], "b:2": ["k900", "k1901", "k1902"]}
    assert held_before(meta, runs, 2) == {"a:1": ["k902"]}  # this run's own calibration, before its requests
    assert held_before({**meta, "probe_templates": 1_000_000}, runs, 1) == {}  # new files: disjoint numbering


def test_block_bootstrap_widens_the_interval_of_a_run_with_one_slow_episode():
    """20 consecutive slow requests (one arrival episode that queued) among 180 fast ones: their P95 interval by
    blocks is wider than an i.i.d. bootstrap's, which treats them as 20 independent draws (block 1)."""
    from maskedit_lab.routing.validate_replay import _p95, block_bootstrap_ci

    lat = np.r_[np.full(90, 1.0), np.linspace(5.0, 10.0, 20), np.full(90, 1.0)]
    lo, hi = block_bootstrap_ci(lat, _p95)
    ilo, ihi = block_bootstrap_ci(lat, _p95, block=1)
    assert lo <= np.percentile(lat, 95) <= hi and hi - lo > 2 * (ihi - ilo)


def test_ranking_claims_only_pairs_the_measurement_tells_apart():
    """Two policies 30 % apart in measured P95 but with overlapping bootstrap intervals are not a distinct pair
    (the old 15 % rule counted them); a pair with disjoint intervals is, and its misorder is reported."""
    from maskedit_lab.routing.validate_replay import ranking

    row = lambda p, model, p95, ci=None: {"policy": p, "load": 0.7, "model": model, "p95_s": p95,  # noqa: E731
                                         **({"p95_ci": ci} if ci else {})}
    rows = [row("a", "measured", 4.0, [3.0, 6.0]), row("b", "measured", 5.2, [4.0, 8.0]),
            row("c", "measured", 12.0, [9.0, 14.0]),
            row("a", "sim", 5.0), row("b", "sim", 4.0), row("c", "sim", 3.0)]
    (r,) = ranking(rows, model="sim")
    assert r["distinct_pairs"] == 2 and not r["distinct_pairs_alike"]
    assert sorted(r["distinct_pairs_misordered"]) == [["a", "c"], ["b", "c"]]
    (old,) = ranking([{k: v for k, v in x.items() if k != "p95_ci"} for x in rows], model="sim")
    assert old["distinct_pairs"] == 3  # the tolerance rule, for files without intervals


def _full_batches(est, host, workers=2, batch=4):
    """``batch`` cached requests on each worker's own template, all at once (round robin: a, b, a, b, ...)."""
    arr = [(0.0, f(t)) for _ in range(batch) for t in "ab"[:workers]]
    held = {"w0": ["a"], "w1": ["b"]} if workers == 2 else {"w0": ["a"]}
    return replay("round_robin", workers, arr, est, host=host, held=held)["requests"]


def test_a_hosts_interference_is_the_mean_over_its_busy_pairs_of_their_fill():
    from maskedit_lab.routing.sim_cluster import _Host, batch_fill

    assert [batch_fill(n, 4) for n in (0, 1, 2, 4, 6)] == pytest.approx([0, 0, 1 / 3, 1, 1])
    h = _Host(2, interference=0.1, interference_full=0.5)
    for fills, expected in (((1.0, 1.0), 0.5), ((1.0, 0.0), 0.1), ((0.0, 0.0), 0.1), ((0.5, 0.5), 0.2),
                            ((1.0, 1.0, 0.0), 0.1 + 0.4 / 3), ((1.0,), 0.1)):
        h.tasks = [[1.0, None, x] for x in fills]
        assert h.pair_interference() == pytest.approx(expected)
    h.interference_full = None  # older calibrations: the batch-1 figure whatever the fill
    h.tasks = [[1.0, None, 1.0], [1.0, None, 1.0]]
    assert h.pair_interference() == 0.1


def test_full_batches_of_cached_requests_interfere_more_than_single_requests(est):
    alone = [latency(q) for q in _full_batches(est, HostModel(2, 1, 0.0, 0.0, interference=0.1,
                                                                 interference_full=0.5), workers=1)]
    assert all(q.cached for q in _full_batches(est, HostModel(2, 2, 0.0, 0.0)))
    old = _full_batches(est, HostModel(2, 2, 0.0, 0.0, interference=0.1))[0::2]  # worker 0's, as ``alone``
    for q, a in zip(old, alone):  # without the full-batch figure (older calibrations): the batch-1 figure
        assert latency(q) == pytest.approx(1.1 * a)
    full = _full_batches(est, HostModel(2, 2, 0.0, 0.0, interference=0.1, interference_full=0.5))[0::2]
    for q, a in zip(full, alone):  # one request in the first step (the rest join at its end), fewer at the end
        assert 1.2 * a < latency(q) < 1.5 * a


def test_single_requests_interfere_by_the_batch_1_figure_whatever_the_full_batch_figure(est):
    one = latency(_full_batches(est, HostModel(2, 1, 0.0, 0.0), workers=1, batch=1)[0])
    for full_figure in (None, 0.5, 2.0):
        for q in _full_batches(est, HostModel(2, 2, 0.0, 0.0, interference=0.1, interference_full=full_figure),
                               batch=1):
            assert latency(q) == pytest.approx(1.1 * one)


def test_foreign_cpu_on_the_host_takes_its_share_of_the_cores(est):
    arr = [(0.0, f("a"))]
    alone = latency(replay("round_robin", 1, arr, est, host=HostModel(1, 1, 0.0, 0.0))["requests"][0])
    busy = HostModel(1, 1, 0.0, 0.0, background=((0.0, 1.0),))  # one foreign core's worth on a 1-core host
    assert latency(replay("round_robin", 1, arr, est, host=busy)["requests"][0]) == pytest.approx(2 * alone)
    spare = HostModel(2, 1, 0.0, 0.0, background=((0.0, 1.0),))  # a core to spare: no slower (no interference)
    assert latency(replay("round_robin", 1, arr, est, host=spare)["requests"][0]) == pytest.approx(alone)
    # foreign work from halfway: the second half at half speed
    late = HostModel(1, 1, 0.0, 0.0, background=((0.0, 0.0), (alone / 2, 1.0)))
    assert latency(replay("round_robin", 1, arr, est, host=late)["requests"][0]) == pytest.approx(1.5 * alone)
