"""The LoRA benchmark's own arithmetic: FLOPs counted on the CPU include attention, and the issue's targets are
read from the rows as stated."""

import torch
import torch.nn.functional as F

from maskedit_lab.addons.bench_addons import count_flops
from maskedit_lab.addons.report import targets


def test_flops_on_the_cpu_count_attention_and_projections():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    assert count_flops(lambda: F.scaled_dot_product_attention(q, k, v)) == 4 * 2 * 64 * 64 * 16
    x, w = torch.randn(10, 32), torch.randn(8, 32)
    assert count_flops(lambda: F.linear(x, w)) == 2 * 10 * 32 * 8


def _row(case, overhead, flop_share, preset="bench", **kw):
    return {"case": case, "preset": preset, "overhead": overhead, "overhead_cpu": overhead,
            "flop_share": flop_share, **kw}


def test_targets_read_from_the_rows():
    rows = [_row("warm-1", 0.05, 0.04), _row("warm-2", 0.2, 0.08), _row("warm-1-merged", 0.0, 0.001),
            _row("warm-2-merged", 0.01, 0.002), _row("cold-host", 0.02, 0.001, e2e_overhead=0.12,
                                                    e2e_overhead_cpu=0.05),
            _row("mixed-batch", 0.3, 0.04, throughput_vs_same_batch=0.95, throughput_vs_same_batch_cpu=0.85),
            _row("warm-2", 0.04, 0.012, preset="flux-width (1 dual + 1 single block)")]
    t = targets(rows)
    assert t["warm-1 overhead <= 1.5 x flop share"] and not t["warm-2 overhead <= 1.5 x flop share"]
    assert t["warm-1-merged overhead <= 1.5 x flop share"] and not t["warm-2-merged overhead <= 1.5 x flop share"]
    assert t["warm-2@fw overhead <= 5%"]
    assert not t["cold-host e2e_overhead <= 10%"] and t["cold-host e2e_overhead_cpu <= 10%"]
    assert t["mixed-batch throughput >= 0.9 x same-batch"] and not t["mixed-batch throughput_cpu >= 0.9 x same-batch"]
    # a partial run into a new file (``--cases warm-1``) is judged on what it measured, not refused with a KeyError
    assert set(targets(rows[:1])) == {"warm-1 overhead <= 1.5 x flop share", "warm-1 overhead_cpu <= 1.5 x flop share"}


def test_a_partial_run_replaces_its_rows_and_keeps_the_others():
    from maskedit_lab.addons.report import merge_rows, with_baselines

    assert with_baselines({"warm-2", "mixed-batch", "fw:warm-2", "naive"}) == {
        "warm-2", "base", "mixed-batch", "base-batch", "fw:warm-2", "fw:base", "naive", "stock-base"}
    old = [_row("base", 0.0, 0.0), _row("cold-host", 0.01, 0.001),
           _row("same-batch", 0.07, 0.04, throughput_rps=1.0, throughput_rps_cpu=1.0),
           _row("same-batch-merged", 0.07, 0.0, throughput_rps=1.1, throughput_rps_cpu=1.2),
           _row("mixed-batch", 0.2, 0.04, throughput_rps=0.8, throughput_rps_cpu=0.8)]
    new = [_row("base", 0.0, 0.0, cpu_s=3.0), _row("same-batch", 0.05, 0.04, throughput_rps=0.5,
                                                   throughput_rps_cpu=0.5),
           _row("mixed-batch", 0.05, 0.04, throughput_rps=0.5, throughput_rps_cpu=0.49)]
    rows = merge_rows(old, new)
    assert [r["case"] for r in rows] == ["base", "cold-host", "same-batch", "same-batch-merged", "mixed-batch"]
    assert rows[0]["cpu_s"] == 3.0 and rows[1] is old[1]
    assert rows[4]["throughput_vs_same_batch"] == 1.0 and rows[4]["throughput_vs_same_batch_cpu"] == 0.98
    assert rows[3]["throughput_vs_same_batch_cpu"] == 2.4  # the kept row's ratio against the new same-set batch
