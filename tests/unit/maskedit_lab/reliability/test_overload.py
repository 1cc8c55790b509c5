"""``make overload``'s judgement: who refused each request, the router's admission A/B, the flood at one server."""

from types import SimpleNamespace

from loadgen import records, runner
from loadgen.records import Record
from maskedit_lab.reliability import capacity, overload, report


def test_overload_results_say_who_refused_each_request():
    def rec(i, code=None, error=None, after=0.1):
        return Record(index=i, template=0, mask_ratio=0.2, arrival_s=0.0, submit_s=0.0, done_s=after,
                      error=error, error_code=code)

    recs = [rec(0), rec(1, "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED: no backend can admit it within 0.6 s: ...", 0.01),
            rec(2, "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED: waited 0.61 s in front of backend a:1's admission check; "
                                         "refused by the router, retry later [request id: c-2]", 0.7),
            rec(3, "RESOURCE_EXHAUSTED", "in ensemble 'edit', RESOURCE_EXHAUSTED: denoise queue is full (8 waiting)", 0.2),
            rec(4, "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED: every backend is at its in-flight limit", 0.02)]
    summary = {"requests": 5, "completed": 1, "errors": {"RESOURCE_EXHAUSTED": 4}, "lost": 0, "p95_s": 0.1,
               "throughput": 1.0}
    j = overload.judge(recs, summary, rate=2.0, cap=1.0)
    assert j["refused_by"] == {"backend": {"n": 1, "max_s": 0.2}, "router_admission": {"n": 1, "max_s": 0.01},
                               "router_inflight": {"n": 1, "max_s": 0.02}, "router_timeout": {"n": 1, "max_s": 0.7}}
    assert j["refused"] == 4 and j["met"] == {"nothing_lost": True, "only_refusals": True, "refusals_within_1s": True}


def test_the_overload_a_b_restarts_the_router_with_and_without_its_admission_and_restores_it(monkeypatch):
    starts = []
    topo = SimpleNamespace(router_args=["--policy", "round_robin"], url="r:1", stop_router=lambda: None)
    topo.start_router = lambda: starts.append(list(topo.router_args))
    recs = [Record(index=0, template=0, mask_ratio=0.2, arrival_s=0.0, submit_s=0.0, done_s=0.5)]
    summary = {"requests": 1, "completed": 1, "errors": {}, "lost": 0, "p95_s": 0.5, "throughput": 2.0}
    seeds = []
    monkeypatch.setattr(capacity, "run_at", lambda url, rate, d, steps, seed: seeds.append(seed) or (recs, summary))
    rows = overload.ab(topo, rate=4.0, duration_s=1.0, pairs=2, steps=8)
    assert [r["admission"] for r in rows] == ["on", "off", "on", "off"] and seeds == [10, 10, 11, 11]
    assert starts[1] == ["--policy", "round_robin", *overload.ADMISSION_OFF] and starts[-1] == topo.router_args
    text = report.overload({"targets": {}, "steps": 8, "max_queue": 2, "all_met": True, "command": "c",
                            "started": "s", "router_ab": rows})
    assert "Served per second, mean: on 2.00 / off 2.00." in text


def test_the_flood_counts_every_request_answered_late_or_lost_and_who_refused(monkeypatch):
    """``make overload``'s flood straight at one server: answered within 10 s (a result or a refusal), late, lost;
    refusals by Triton's queue in front of pre-processing told from the backend's own checks (the time bound at the
    front, at denoise, at the front of its queue; the count); a request ended at its bound counted apart."""
    def rec(i, done, error=None, code=None):
        return records.Record(index=i, template=0, mask_ratio=0.2, arrival_s=0.0, submit_s=0.0, done_s=done,
                              error=error, error_code=code)

    recs = [rec(0, 2.0), rec(1, 0.05, "RESOURCE_EXHAUSTED: the server's queue is full (refused before any work): "
                                     "in ensemble 'edit', [request id: a-1] Exceeds maximum queue size",
                               "RESOURCE_EXHAUSTED"),
            rec(2, 12.0, "UNAVAILABLE: RESOURCE_EXHAUSTED: denoise queue is full (8 waiting)", "RESOURCE_EXHAUSTED"),
            rec(3, None), rec(4, 3.0),
            rec(5, 0.4, "UNAVAILABLE: RESOURCE_EXHAUSTED: cannot be answered within 10 s of its arrival (...); refused "
                        "before any work; retry in ~3 s or send it to another server", "RESOURCE_EXHAUSTED"),
            rec(6, 1.5, "UNAVAILABLE: RESOURCE_EXHAUSTED: would delay 1 requests already taken past their bounds (...); "
                        "refused before denoising; retry in ~1 s", "RESOURCE_EXHAUSTED"),
            rec(7, 4.0, "UNAVAILABLE: RESOURCE_EXHAUSTED: waited 4.0 s since its arrival and can no longer be answered "
                        "within 10 s of it (...); refused before it started (MASKEDIT_LATENCY_BOUND_S)",
                "RESOURCE_EXHAUSTED"),
            rec(8, 9.8, "UNAVAILABLE: DEADLINE_EXCEEDED: ran out of its bound of 10 s after its arrival "
                        "(MASKEDIT_LATENCY_BOUND_S) with 3 steps left: ...", "DEADLINE_EXCEEDED"),
            rec(9, 0.02, "in ensemble 'edit', RESOURCE_EXHAUSTED: pre-processing's queue is full (16 waiting; "
                         "refused on arrival, before any work): send again later or to another server [request id: "
                         "a-9]", "RESOURCE_EXHAUSTED")]  # the backend's intake (maskedit.intake)
    recs[3].error, recs[3].error_code = "no result", runner.LOST
    sent = []
    monkeypatch.setattr(runner, "run", lambda c, reqs, *a, **k: sent.append(len(reqs)) or (recs, 20.0))
    _, f = overload.flood("127.0.0.1:1", n=9, spread_s=1.0, steps=2, within_s=10.0)
    assert sent == [9]
    assert (f["ok"], f["refused"], f["ended_at_bound"], f["late"], f["lost"]) == (2, 6, 1, 1, 1)
    assert f["refused_by"] == {"queue_full": {"n": 1, "max_s": 12.0}, "triton_queue": {"n": 1, "max_s": 0.05},
                               "intake_full": {"n": 1, "max_s": 0.02},
                               "bound_front": {"n": 1, "max_s": 0.4}, "bound_denoise": {"n": 1, "max_s": 1.5},
                               "bound_queue": {"n": 1, "max_s": 4.0}}
    assert f["met"] == {"all_within": False, "nothing_lost": False, "only_refusals": True}
    assert len(f["load_average"]["before"]) == 3
    text = report.overload({"targets": {}, "steps": 8, "max_queue": 8, "all_met": False, "command": "c",
                            "started": "s", "flood": f, "latency_bound_s": 10.0})
    assert "| 9 in 1 s at one server | 9 | 2 | 6 |" in text and "intake_full 1 (0.02)" in text, text
    assert "| 1 (9.80) |" in text and "MASKEDIT_LATENCY_BOUND_S) 10 s" in text, text
    rec8 = recs[8]
    rec8.error = "UNAVAILABLE: DEADLINE_EXCEEDED: something else"  # not the bound's: another error
    _, f = overload.flood("127.0.0.1:1", n=9, spread_s=1.0, steps=2, within_s=10.0)
    assert f["other_errors"] == {"DEADLINE_EXCEEDED": 1} and not f["met"]["only_refusals"]
