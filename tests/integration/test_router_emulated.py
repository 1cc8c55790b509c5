"""The real router process in front of emulated Triton instances (``maskedit_lab.routing.triton_emulator``): the router
finds them healthy (readiness, its health probe edit, the admission statistics it polls), forwards metadata and
config, streams edits with progress to them and relays every response; the emulated instances take their time from
the cost-model profile and keep a template's entry, so a repeated template comes back as a hit on the same one."""

import json
import time

import pytest
import tritonclient.grpc as grpcclient

from loadgen import workload
from loadgen.runner import Assets
from maskedit_client import EditClient
from maskedit_common.cost_model import CostModel
from maskedit_lab.routing.scale import running_emulator, running_router
from maskedit_router.__main__ import default_profile
from maskedit_router.placement.features import EditFeatures, mask_ratio
from maskedit_router.placement.policies import Estimator

SCALE = 0.05


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    out = tmp_path_factory.mktemp("emulated")
    profile = default_profile()
    stats = out / "stats.json"
    with running_emulator(3, profile, SCALE, out, stats=stats) as (_, addrs):
        from maskedit_lab.routing.triton_emulator import scaled_profile

        scaled = scaled_profile(profile, SCALE, out / "scaled.json")
        with running_router(addrs, scaled, out, "predicted", []) as (_, url, http_port):
            yield {"url": url, "http": http_port, "addrs": addrs, "profile": profile}
    served = json.loads(stats.read_text())  # the counts each instance wrote as it stopped
    assert sum(s["edits"] for s in served) >= 4 and sum(s["hits"] for s in served) >= 2


def _health(port):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return json.loads(r.read())


def test_router_takes_emulated_instances_into_rotation_and_forwards_metadata(routed):
    h = _health(routed["http"])
    assert h["ready"] and len(h["backends"]) == 3
    assert all(b["in_rotation"] for b in h["backends"])
    deadline = time.monotonic() + 10  # the admission watcher read each instance's preprocess statistics
    while not all(b["admission"]["observed"] for b in _health(routed["http"])["backends"]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    c = grpcclient.InferenceServerClient(routed["url"])
    assert c.is_server_ready() and c.is_model_ready("edit")
    meta = c.get_model_metadata("edit")
    assert meta.name == "edit" and {i.name for i in meta.inputs} >= {"TEMPLATE", "MASK", "PROMPT", "LORAS"}
    assert c.get_model_config("edit").config.platform == "ensemble"
    c.close()


def test_edits_stream_through_the_router_with_profile_timing_and_cache_affinity(routed):
    assets = Assets(512)
    est = Estimator(CostModel.load_file(routed["profile"]))
    with EditClient(routed["url"]) as client:
        results = []
        for i in range(3):  # the same template three times: a template run, then hits on the same instance
            r = workload.Request(0.0, 7, 0.2, "blob", "a photo", steps=8, seed=i)
            progress = []
            res = client.submit(assets.template(7), assets.mask(r), r.prompt, seed=r.seed, steps=8,
                                on_progress=lambda step, steps: progress.append(step)).result(60)
            results.append((res, progress, mask_ratio(assets.mask(r), 512)[0]))
    infos = [res.info for res, _, _ in results]
    assert all(i["emulated"] for i in infos)
    assert [i["cache_hit"] for i in infos] == [False, True, True]
    assert len({i["instance"] for i in infos}) == 1  # affinity: the instance that holds the entry
    assert all(len(p) == 7 and p == sorted(p) for _, p, _ in results)  # a progress response per step but the last
    for res, _, ratio in results[1:]:  # an isolated hit: the profile's time for it, compressed by the time scale
        f = EditFeatures("k", ratio, 1024, 8)
        modelled = (est.request_ms(f, True) + 8 * 2.0) * SCALE / 1000
        assert res.info["denoise_s"] == pytest.approx(modelled, rel=0.02)
    miss = EditFeatures("k", results[0][2], 1024, 8)
    assert infos[0]["denoise_s"] == pytest.approx((est.request_ms(miss, False) + 16.0) * SCALE / 1000, rel=0.02)


def test_a_bad_request_gets_a_clear_error_and_the_instance_keeps_serving(routed):
    from maskedit_client import EditError

    assets = Assets(512)
    with EditClient(routed["url"], retry=False) as client:
        with pytest.raises(EditError, match="MASK"):
            client.submit(assets.template(1), b"not an image", "x", steps=8).result(30)
        r = workload.Request(0.0, 1, 0.1, "blob", "x", steps=8)
        assert client.submit(assets.template(1), assets.mask(r), "x", steps=8).result(30).info["emulated"]


def test_make_router_scale_runs_end_to_end_at_a_tiny_setting(tmp_path):
    """Both parts of ``make router-scale`` (the overhead ladder and the policies through the real router) at a size
    that takes seconds: nothing else runs them before a quiet-host run (an undefined name once cost one)."""
    from maskedit_lab.routing import scale

    out = tmp_path / "router_scale.json"
    scale.main(["--instances", "2", "--rates", "5", "--window-s", "2", "--compare-workers", "2", "--loads", "0.5",
                "--policies", "predicted", "--requests", "20", "--out", str(out)])
    doc = json.loads(out.read_text())
    kinds = {r["kind"] for r in doc["rows"]}
    assert {"overhead", "policy"} <= kinds, kinds
    over = [r for r in doc["rows"] if r["kind"] == "overhead"]
    assert over[0]["ok"] == over[0]["requests"] and over[0]["emulated_instances"]
    # the same-run direct baseline: both paths answered in full, in ABBA order, and the hop judged
    assert over[0]["direct_ok"] == over[0]["requests"] and over[0]["block_order"] == "DRRD"
    assert over[0]["router_hop_ms_p99"] is not None and doc["meta"]["target_judged_on"] == "router_hop_ms_p99"
    # read from the router's own metrics: every routed request's features read, its admission watcher polling
    assert over[0]["features_ms_p99"] is not None and over[0]["admission_polls_per_s_idle"] > 0
    assert out.with_suffix(".png").exists()
