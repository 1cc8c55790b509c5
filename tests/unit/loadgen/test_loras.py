"""Loadgen replays the GenTD26 trace's ``num_lora``: each request carries that many distinct adapters, drawn with
a seed (the same seed draws the same adapters; the rest of the workload is unchanged by the draw), Zipf-popular
over the library in its order, and they reach the client as ``loras``."""

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np

from loadgen import runner, workload

LIB = [f"lora-{i}" for i in range(8)]


def test_the_draw_is_seeded_follows_num_lora_and_is_zipf_over_the_library():
    n = workload.gentd26_num_lora(limit=1000, start=500)
    t, _ = workload.gentd26_arrivals(limit=1000, start=500)
    assert len(n) == len(t) == 1000 and 0.1 < np.mean([k > 0 for k in n]) < 0.5  # the trace's share with LoRA
    assert max(n) >= 2 and n == workload.gentd26_num_lora()[500:1500]
    reqs = workload.assign_loras(workload.synthesize(t, seed=3), n, LIB, seed=3)
    plain = workload.synthesize(t, seed=3)
    assert [(r.template, r.mask_ratio, r.seed) for r in reqs] == [(r.template, r.mask_ratio, r.seed) for r in plain]
    for r, k in zip(reqs, n):
        names = [x[0] for x in r.loras or []]
        assert len(names) == min(k, 4) and len(set(names)) == len(names) and set(names) <= set(LIB)
        assert all(0.5 <= x[1] <= 1.0 for x in r.loras or [])
    again = workload.assign_loras(workload.synthesize(t, seed=3), n, LIB, seed=3)
    other = workload.assign_loras(workload.synthesize(t, seed=3), n, LIB, seed=4)
    assert [r.loras for r in again] == [r.loras for r in reqs]
    assert [r.loras for r in other] != [r.loras for r in reqs]
    # Zipf: the library's first adapter drawn most, the last least
    many = workload.zipf_loras([1] * 20000, LIB, 1.1, np.random.default_rng(0))
    counts = np.bincount([LIB.index(x[0][0]) for x in many], minlength=len(LIB))
    assert list(counts) == sorted(counts, reverse=True) and counts[0] > 4 * counts[-1]
    assert workload.zipf_loras([2, 0], [], 1.1, np.random.default_rng(0)) == [[], []]


def test_the_runner_sends_them_and_traces_keep_them(tmp_path):
    sent = []

    class _Client:
        def submit(self, *a, **kw):
            sent.append(kw.get("loras"))
            f = Future()
            f.set_result(SimpleNamespace(info={}, png=b""))
            return f

    class _Assets:
        def template(self, i):
            return b""

        def mask(self, r):
            return b""

    reqs = workload.assign_loras(workload.poisson(100.0, 3, seed=0), [2, 0, 1], LIB, seed=1)
    runner.run(_Client(), reqs, _Assets(), timeout_s=1, progress=False)
    assert [len(x or ()) for x in sent] == [2, 0, 1] and all(isinstance(p, tuple) for p in sent[0])
    workload.save_trace(reqs, tmp_path / "t.jsonl")
    assert [r.loras for r in workload.load_trace(tmp_path / "t.jsonl")] == [r.loras for r in reqs]
