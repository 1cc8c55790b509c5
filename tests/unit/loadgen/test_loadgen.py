import numpy as np
import pytest

from loadgen import records, workload

TRACE = workload.GENTD26  # shipped with the project: any clone can replay it


def test_poisson_rate_and_reproducible():
    a = workload.poisson(4.0, 4000, seed=1)
    assert len(a) / a[-1].t == pytest.approx(4.0, rel=0.05)
    assert [r.t for r in workload.poisson(4.0, 10, seed=1)] == [r.t for r in a[:10]]


@pytest.mark.parametrize("name", sorted(workload.WORKLOADS))
def test_mask_ratio_means_match_the_paper(name):
    r = workload.mask_ratios(name, 20000, np.random.default_rng(0))
    assert r.mean() == pytest.approx(workload.WORKLOADS[name]["mean"], abs=0.01)
    assert r.std() > 0.05  # spread, not a constant


def test_zipf_popularity():
    t = workload.zipf_templates(20000, 8, 1.1, np.random.default_rng(0))
    counts = np.bincount(t, minlength=8)
    assert list(counts) == sorted(counts, reverse=True) and counts[0] > 3 * counts[7]


def test_gentd26_arrivals_are_replayed_in_order():
    assert TRACE.exists()
    t, steps = workload.gentd26_arrivals(TRACE, time_scale=60, limit=500)
    assert len(t) == 500 and t[0] == 0 and np.all(np.diff(t) >= -1 / 60) and all(s >= 0 for s in steps)
    t_all, _ = workload.gentd26_arrivals(TRACE, time_scale=1, types=())
    assert len(t_all) == 26823


def test_trace_roundtrip(tmp_path):
    reqs = workload.poisson(2.0, 5, deadline_ms=900)
    workload.save_trace(reqs, tmp_path / "t.jsonl")
    assert workload.load_trace(tmp_path / "t.jsonl") == reqs


def test_summary_counts_goodput_and_errors():
    recs = [records.Record(i, 0, 0.2, 0, 0.0, done_s=d, deadline_ms=1000) for i, d in enumerate([0.5, 2.0])]
    recs.append(records.Record(2, 0, 0.2, 0, 0.0, done_s=0.1, error="x", error_code="DEADLINE_EXCEEDED"))
    s = records.summarize(recs, wall_s=10.0)
    assert s["completed"] == 2 and s["goodput"] == pytest.approx(0.1) and s["errors"] == {"DEADLINE_EXCEEDED": 1}


def test_the_runner_records_what_the_service_did_and_never_waits_forever():
    """A request that never answers is LOST after the timeout, and the client's own cancel when it closes later
    does not relabel it CANCELLED; a backend failure keeps its code."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from loadgen import runner
    from maskedit_client import EditError

    futs = []

    class _Client:  # answers the first request, fails the second, never answers the third
        def submit(self, *a, **kw):
            f = Future()
            futs.append(f)
            if len(futs) == 1:
                f.set_result(SimpleNamespace(info={"cache_hit": True}))
            elif len(futs) == 2:
                f.set_exception(EditError("UNAVAILABLE: backend failed [request id: x-1]", "UNAVAILABLE"))
            return f

    class _Assets:
        def template(self, i):
            return b""

        def mask(self, r):
            return b""

    reqs = workload.poisson(50.0, 3, seed=0)
    recs, wall = runner.run(_Client(), reqs, _Assets(), timeout_s=0.5, progress=False)
    futs[2].set_exception(EditError("cancelled by the client", "CANCELLED"))  # what EditClient.close does
    assert [r.error_code for r in recs] == [None, "UNAVAILABLE", runner.LOST]
    s = records.summarize(recs, wall)
    assert s["lost"] == 1 and s["errors"] == {"UNAVAILABLE": 1, "LOST": 1} and wall < 5
