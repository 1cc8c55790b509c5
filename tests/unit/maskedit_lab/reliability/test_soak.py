"""``make soak``'s memory judgement."""

import os
from types import SimpleNamespace

import numpy as np

from maskedit_lab.reliability import footprint, soak


def test_the_soak_judges_memory_outside_the_store_entries_a_process_has_mapped(tmp_path):
    """Touched pages of a mapped store file count in RSS; the soak subtracts them (smaps) and bounds them apart."""
    store, other = tmp_path / "store", tmp_path / "other"
    for d in (store, other):
        d.mkdir()
        (d / "e.safetensors").write_bytes(b"\1" * (4 << 20))
    maps = [np.memmap(d / "e.safetensors", dtype=np.uint8, mode="r") for d in (store, other)]
    assert all(int(m[: 2 << 20].sum()) == 2 << 20 for m in maps)  # touch half of each
    # only the store's file, only what was touched (the kernel may map a few pages around a fault)
    assert 2 << 20 <= footprint.mapped_rss(os.getpid(), [store]) < 3 << 20
    assert footprint.mapped_rss(os.getpid(), [tmp_path / "none"]) == 0

    samples = [{"t_s": t, "rss": {"s/stub:masked_denoise": (500 << 20) + m}, "store_rss": {"s/stub:masked_denoise": m}}
               for t, m in ((0, 0), (600, 30 << 20), (1200, 60 << 20))]
    assert soak._own(samples[2], "s/stub:masked_denoise") == 500 << 20
    assert soak.slope_mb_per_10min(samples, lambda x: soak._own(x, "s/stub:masked_denoise"), 0) == 0
    batching = SimpleNamespace(max_batch=4, max_queue=64)
    check = soak.store_mapped_check(samples, 1 << 20, batching)
    assert check["bound_entries"] == 64 + 4 + 64 and check["within_bound"] and check["peak_mb"] == {
        "s/stub:masked_denoise": 60.0}
    assert not soak.store_mapped_check(samples, 100 << 10, batching)["within_bound"]
