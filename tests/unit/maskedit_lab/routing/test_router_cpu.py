"""`make router-cpu`: the stages run on router-scale's requests, the before/after pair reads the same features, and
the run writes its JSON and plot."""

import json

from maskedit_lab.routing import router_cpu
from maskedit_router.placement import features


def test_the_box_grid_variant_reads_the_same_features_and_restores_the_fast_path():
    fns, meta = router_cpu.stages(512, requests=6, n_masks=6)
    fast, _ = fns["features"]
    box, ctx = fns["features_box_grid"]
    got = [fast(i) for i in range(6)]
    with ctx():
        assert features.ANY_CELL_MAX == 0
        assert [box(i) for i in range(6)] == got  # the same decisions' inputs, field for field
    assert features.ANY_CELL_MAX > 0
    assert meta["request_bytes"] > meta["template_bytes"] > 100_000


def test_the_mask_memory_pair_reads_the_same_features_one_decoding_every_mask():
    fns, _ = router_cpu.stages(512, requests=8, n_masks=4)
    once, ctx = fns["features"]
    again, none = fns["features_mask_again"]
    assert none is None
    saved = features.MASK_RATIOS
    with ctx():
        memory = features.MASK_RATIOS
        got = [once(i) for i in range(8)]
        assert memory is not saved and (memory.hits, memory.misses) == (0, 8)  # masks 0-3 twice: decoded each time
    assert features.MASK_RATIOS is saved
    assert [again(i) for i in range(8)] == got


def test_a_tiny_run_writes_json_and_a_plot(tmp_path):
    out = tmp_path / "rc.json"
    router_cpu.main(["--requests", "2", "--repeats", "1", "--no-streams", "--out", str(out)])
    result = json.loads(out.read_text())
    assert {r["stage"] for r in result["rows"]} >= {"parse", "features", "features_box_grid", "serialise"}
    assert all(r["cpu_ms_per_request_median"] >= 0 for r in result["rows"])
    assert set(result["ratios"]) == {"features_vs_box_grid", "mask_grid_vs_box", "features_mask_again_vs_sent_once",
                                     "template_xxh3_vs_sha1"}
    assert result["meta"]["clock"].startswith("time.process_time")
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_stream_stages_sync_and_aio_round_trip_through_an_emulated_instance():
    rows = {r["stage"]: r for r in router_cpu.stream_rows(512, requests=3, repeats=1)}
    assert set(rows) == {"backend_stream_per_request", "backend_stream_reused", "backend_stream_reused_aio"}
    assert all(r["cpu_ms_per_request_median"] > 0 and r["wall_ms_per_round_trip_median"] > 0 for r in rows.values())
