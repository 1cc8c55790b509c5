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


# -- the overhead rung's row, the result's meta, the plot (issue 43: the same-run direct baseline) ----------------
def _sent(added_ms: list[float], late_ms: float = 0.0, service_s: float = 0.01):
    from maskedit_lab.routing.scale import Sent

    out = []
    for i, a in enumerate(added_ms):
        at = 0.04 * i
        out.append(Sent(at, None, sent=at + late_ms / 1000, done=at + late_ms / 1000 + service_s + a / 1000,
                        service_s=service_s))
    return out


def _blocks(direct_ms, routed_ms, late_ms=0.0):
    from maskedit_lab.routing.scale import Block

    direct, routed = Block(), Block()
    direct.add(_sent(direct_ms, late_ms), 4.0, {"router": 1.0, "emulator": 2.0, "loadgen": 3.0},
               {"router": 1.2, "emulator": 2.4, "loadgen": 3.2})
    routed.add(_sent(routed_ms, late_ms), 4.0, {"router": 1.2, "emulator": 2.4, "loadgen": 3.2},
               {"router": 2.2, "emulator": 2.8, "loadgen": 3.5})
    return direct, routed


def _row(direct, routed, idle=0.05):
    from maskedit_lab.routing.scale import overhead_row

    return overhead_row(32, "predicted", 25.0, direct, routed, idle_cpu_per_s=idle, decision_s=(2e-4, 1.8e-3),
                        fit={"scale": 1.0}, request_bytes=412345.6, order="DRRD", loadavg_before=(0.5, 0.4, 0.3),
                        loadavg_after=(0.7, 0.5, 0.3), target_ms=5.0, features_s=(7e-4, 2.4e-3), polls_per_s=40.04,
                        idle_polls_per_s=1.96)


def test_a_rungs_row_carries_both_paths_the_hop_and_every_processs_cpu():
    direct, routed = _blocks([20.0 + 0.1 * i for i in range(100)], [23.0 + 0.1 * i for i in range(100)])
    row = _row(direct, routed)
    assert row["emulated_instances"] is True and row["instances"] == 32 and row["requests"] == 100
    assert row["router_hop_ms_p50"] == pytest.approx(3.0) and row["router_hop_ms_p99"] == pytest.approx(3.0)
    assert row["added_ms_p99"] > 5.0 and row["within_target"] and not row["within_target_added"]
    assert row["router_cpu_ms_per_request_gross"] == pytest.approx(10.0)  # 1.0 s of router CPU, 100 answered
    assert row["router_cpu_ms_per_request"] == pytest.approx(8.0)  # less 0.05 cores over the routed 4 s
    assert row["router_cpu_cores_direct"] == pytest.approx(0.05)  # the router's idle cost beside the direct block
    assert row["emulator_cpu_cores"] == pytest.approx(0.1) and row["emulator_cpu_cores_direct"] == pytest.approx(0.1)
    assert row["loadgen_cpu_ms_per_request"] == pytest.approx(3.0)
    assert row["loadgen_cpu_ms_per_request_direct"] == pytest.approx(2.0)
    assert row["request_bytes"] == 412345 and row["segments"] == 2 and row["block_order"] == "DRRD"
    assert row["loadavg_before"] == [0.5, 0.4, 0.3] and row["loadavg_1m"] == 0.7
    assert row["decision_ms_p99"] == pytest.approx(1.8) and row["generator_kept_up"]
    assert row["features_ms_p50"] == pytest.approx(0.7) and row["features_ms_p99"] == pytest.approx(2.4)
    assert row["admission_polls_per_s"] == 40.0 and row["admission_polls_per_s_idle"] == 2.0
    json.dumps(row)  # plain JSON


def test_a_rung_misses_on_a_slow_hop_a_lost_direct_request_or_a_late_generator():
    slow = _row(*_blocks([1.0] * 100, [9.0] * 100))
    assert slow["router_hop_ms_p99"] == pytest.approx(8.0) and not slow["within_target"]
    direct, routed = _blocks([1.0] * 100, [2.0] * 100)
    direct.items[0].error, direct.items[0].service_s = "LOST: no answer", None
    lost = _row(direct, routed)
    assert lost["direct_errors"] == 1 and lost["direct_error_kinds"] == {"LOST": 1} and not lost["within_target"]
    assert not _row(*_blocks([1.0] * 100, [2.0] * 100, late_ms=6.0))["generator_kept_up"]


def test_the_result_names_emulated_instances_the_device_the_commit_and_its_columns():
    from types import SimpleNamespace

    from maskedit_lab.routing.scale import meta, parser

    args = parser().parse_args(["--instances", "2", "--out", "/tmp/x.json"])
    m = meta(args, ["--instances", "2"], PROFILE, 512, SimpleNamespace(base=b"x" * 100, masks=[b"m" * 10, b"m" * 20]))
    assert m["device"] == "cpu" and "emulated" in m["emulated_instances"] and "instances" not in m
    assert len(m["commit"]) == 40 and isinstance(m["commit_dirty"], bool)
    assert m["target_judged_on"] == "router_hop_ms_p99"
    assert "difference of percentiles" in m["fields"]["router_hop_ms_p50/p99"]
    assert m["template_bytes"] == 100 and m["mask_bytes_mean"] == 15 and m["loadgen_cpu"] == "psutil"
    json.dumps(m)


def test_the_plot_draws_direct_routed_and_hop_and_reads_rows_without_a_direct_baseline(tmp_path):
    from maskedit_lab.routing.scale import plot

    new = _row(*_blocks([1.0] * 50, [2.0] * 50))
    old = {k: v for k, v in new.items() if not k.startswith(("direct_", "router_hop"))} | {"instances": 128}
    plot([new, old], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_the_switch_interval_reaches_the_router_process_only(tmp_path):
    import subprocess
    import sys

    from maskedit_lab.routing.scale import switch_interval_env

    probe = [sys.executable, "-c", "import sys; print(sys.getswitchinterval())"]
    env = switch_interval_env(0.5, tmp_path)
    assert float(subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout) == 0.0005
    assert float(subprocess.run(probe, capture_output=True, text=True, check=True).stdout) == 0.005  # the default


def test_a_router_given_its_own_cores_runs_there_with_every_thread_it_starts():
    import os
    import subprocess
    import sys

    from maskedit_lab.routing.scale import _on_cpus

    probe = [sys.executable, "-c", "import os, threading\n"
             "seen = []\nt = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
             "t.start(); t.join(); print(seen[0], sorted(os.sched_getaffinity(0)))"]
    one = min(os.sched_getaffinity(0))
    out = subprocess.run(_on_cpus(probe, (one,)), capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"[{one}]", f"[{one}]"]
    assert _on_cpus(probe, None) == _on_cpus(probe, ()) == probe  # anywhere: the command as it is


def test_direct_streams_go_round_robin_over_the_instances_and_stay_open_across_blocks():
    """The direct path against two in-process emulated instances: request i reaches instance i mod 2, each answer
    carries the instance's own time, and a second block on the same streams is answered too."""
    import asyncio

    from maskedit_lab.routing.scale import Payloads, Sent, Streams, edit_request
    from maskedit_lab.routing.triton_emulator import EmulatedCluster, EmulatorConfig

    payloads = Payloads(512, n_masks=4)

    async def run():
        cluster = await EmulatedCluster(EmulatorConfig(PROFILE, time_scale=0.002), 2).start()
        try:
            reqs = [edit_request(payloads, f"k{i % 3}", 1 + i % 3, 2) for i in range(6)]
            async with Streams(cluster.addrs, streams=8) as client:
                assert client.streams == 8  # 4 per instance
                blocks = []
                for tag in ("a", "b"):
                    items = [Sent(0.01 * i, r) for i, r in enumerate(reqs)]
                    await client.send(items, wait_s=20, tag=tag)
                    blocks.append(items)
            return cluster.addrs, blocks
        finally:
            await cluster.stop()

    addrs, blocks = asyncio.run(run())
    for items in blocks:
        assert [s.error for s in items] == [None] * 6
        assert all(s.service_s is not None and s.done >= s.sent for s in items)
        assert [s.instance.split("@")[1] for s in items] == [addrs[i % 2] for i in range(6)]


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


def test_masks_sent_once_are_new_bytes_of_the_same_mask():
    """--masks sent-once: each request's mask is bytes the router has not seen (its mask memory misses) that still
    decode to the pool's mask (a PNG reader stops at IEND); pooled: the same bytes again."""
    from maskedit_lab.routing.scale import Payloads, edit_request
    from maskedit_router.placement import features

    once, pooled = Payloads(512, n_masks=4, masks_sent_once=True), Payloads(512, n_masks=4)
    assert once.mask(2) != once.mask(2) and pooled.mask(2) == pooled.mask(2) == pooled.masks[2]
    assert features.mask_ratio(once.mask(2), 512) == features.mask_ratio(pooled.masks[2], 512)
    memory = features.MaskRatios()
    for payloads in (once, once, pooled, pooled):
        req = edit_request(payloads, "k", 2, 4)
        mask = features._tensor_bytes(req, [t.name for t in req.inputs].index("MASK"), True)
        assert memory(mask, 512, None)[0] == pytest.approx(float(pooled.ratios[2]))
    assert (memory.misses, memory.hits) == (3, 1)


@pytest.mark.parametrize("image_bytes", [0, 300_000])
def test_an_emulated_result_carries_an_image_of_the_size_asked(image_bytes):
    """The router relays a real instance's edited PNG (~0.3-0.5 MB at 512²); router-scale's instances answer that
    many bytes (``--answer-bytes``), or a few with 0."""
    import asyncio
    import struct

    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from maskedit_lab.routing.scale import Payloads, edit_request
    from maskedit_lab.routing.triton_emulator import EmulatedCluster, EmulatorConfig

    req = edit_request(Payloads(512, n_masks=4), "k", 1, 2)
    req.id = "r1"

    async def run():
        cluster = await EmulatedCluster(EmulatorConfig(PROFILE, time_scale=0.002, image_bytes=image_bytes), 1).start()
        try:
            async with grpc.aio.insecure_channel(cluster.addrs[0], options=[
                    ("grpc.max_receive_message_length", -1)]) as ch:
                call = service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer()
                await call.write(req)
                got = await asyncio.wait_for(call.read(), 20)
                await call.done_writing()
                return got
        finally:
            await cluster.stop()

    r = asyncio.run(run()).infer_response
    blob = r.raw_output_contents[[o.name for o in r.outputs].index("IMAGE")]
    n = struct.unpack("<I", blob[:4])[0]
    assert n == len(blob) - 4 == (image_bytes or len(b"emulated"))
