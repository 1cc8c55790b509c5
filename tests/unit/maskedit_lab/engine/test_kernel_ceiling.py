"""The kernel-ceiling call lists must describe the same work as the FLOP model."""

import pytest

from maskedit_common.flops import block_flops
from maskedit_lab.engine.kernel_ceiling import KernelTimer, _calls
from maskedit_common.blocks import FULL, KV, Y


def _flops(calls, dim):
    return sum(2 * c[1] * c[2] * c[3] if c[0] == "mm" else 4 * c[1] * c[2] * dim for c in calls)


@pytest.mark.parametrize("mode", [FULL, Y, KV, "noctx"])
@pytest.mark.parametrize("dual", [True, False])
@pytest.mark.parametrize("c", [0, 37, 256])
def test_calls_match_flop_model(mode, dual, c):
    n, text, dim = 256, 16, 64
    assert _flops(_calls(mode, dual, n, c, text, dim), dim) == block_flops(mode, dual, n, c, text, dim)


def test_full_plan_ceiling_is_one_and_masked_plans_are_faster():
    timer = KernelTimer(heads=2, reps=2)
    modes = [FULL] * 3
    assert timer.ceiling_speedup(modes, 1, 256, 256, 16, 32) == pytest.approx(1.0)
    # Full computation is ~60x the masked work here (12-20x measured on a quiet host, edges included). Each shape is
    # timed once, so one preemption on a loaded host can inflate a single masked shape past the whole full step
    # (0.47x seen beside two CPU hogs): the claim is that fresh timings show more than 2x in one of three tries. Call
    # lists that did the full work would sit near 1x in all three.
    assert max(KernelTimer(heads=2, reps=2).ceiling_speedup([KV] * 3, 1, 1024, 16, 16, 64) for _ in range(3)) > 2.0


def test_streamed_weights_cycle_through_a_pool(monkeypatch):
    """With a pool, consecutive GEMM calls read different weight matrices (else the weights stay cache-hot)."""
    import torch.nn.functional as F

    seen, real = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b: (seen.append(w.data_ptr()), real(x, w, b))[1])
    KernelTimer(heads=2, reps=2, stream_bytes=4 * 32 * 32 * 8).call_s(("mm", 4, 32, 32), 32)
    assert len(seen) == 5 and len(set(seen)) == 5  # 3 warm-up + 2 timed calls, each on its own matrix of 8
    seen.clear()
    KernelTimer(heads=2, reps=2).call_s(("mm", 4, 32, 32), 32)
    assert len(set(seen)) == 1  # hot: one matrix


def test_batching_ceiling_batches_gemm_rows_and_repeats_attention():
    """With a fake clock where a GEMM costs a fixed setup plus its rows and attention its queries, batching gains
    exactly the setups it shares; batch 1 gains nothing."""
    class Fake(KernelTimer):
        def call_s(self, call, dim):
            return 10.0 + call[1] if call[0] == "mm" else float(call[1])

    t = Fake(heads=2)
    modes = [KV] * 3
    assert t.batching_ceiling(modes, 1, 256, 16, 8, 32, batch=1) == pytest.approx(1.0)
    one = t.step_s(modes, 1, 256, 16, 8, 32)
    mms = sum(1 for i in range(3) for c in _calls(KV, i < 1, 256, 16, 8, 32) if c[0] == "mm") + 2  # + edges
    assert t.step_s(modes, 1, 256, 16, 8, 32, batch=4) == pytest.approx(4 * one - 3 * 10.0 * mms)
