"""The served-vs-stock case loop of the in-process ControlNet benches (``maskedit_lab.addons.side_by_side``): rounds
alternate every case and both sides, round 0 is a warm-up left out, and the rows keep each bench's JSON schema."""

import json

import pytest

from maskedit_lab.addons import side_by_side


def test_rounds_alternate_cases_and_sides_after_one_untimed_warm_up(monkeypatch):
    calls = []
    clock = iter(range(1000))
    monkeypatch.setattr(side_by_side.time, "perf_counter", lambda: next(clock))
    cases = {c: (lambda i, c=c: calls.append((c, "served", i)), lambda i, c=c: calls.append((c, "stock", i)))
             for c in ("base", "cn1")}
    times = side_by_side.alternate(cases, reps=2)
    assert calls == [(c, side, i) for i in range(3) for c in ("base", "cn1") for side in ("served", "stock")]
    assert {c: (len(s), len(k)) for c, (s, k) in times.items()} == {"base": (2, 2), "cn1": (2, 2)}
    assert all(t == 1 for s, k in times.values() for t in s + k)  # each call: one tick of the fake clock


def _times():
    return {"base": ([2.0, 1.0, 4.0], [3.0, 2.0, 2.5]), "cn1": ([3.0, 5.0, 4.0], [6.0, 3.0, 9.0])}


def test_fastest_rows_carry_the_medians_beside_them():
    rows = side_by_side.rows(_times(), {"base": 0, "cn1": 1}, steps=4, headline="fastest")
    assert [list(r) for r in rows] == [["case", "controls", "served_s", "stock_s", "served_median_s", "stock_median_s",
                                        "served_runs", "stock_runs", "served_over_base", "stock_over_served",
                                        "served_per_step_s"]] * 2
    base, cn1 = rows
    assert (base["served_s"], base["stock_s"], base["served_median_s"], base["stock_median_s"]) == (1.0, 2.0, 2.0, 2.5)
    assert (cn1["served_over_base"], cn1["stock_over_served"], cn1["served_per_step_s"]) == (3.0, 1.0, 0.75)
    json.dumps(rows)


def test_median_rows_report_the_median_as_the_headline():
    rows = side_by_side.rows(_times(), {"base": 0, "cn1": 1}, steps=4, headline="median")
    assert [list(r) for r in rows] == [["case", "controls", "served_s", "stock_s", "served_runs", "stock_runs",
                                        "served_over_base", "stock_over_served", "served_per_step_s"]] * 2
    assert [(r["served_s"], r["stock_s"]) for r in rows] == [(2.0, 2.5), (4.0, 6.0)]
    assert rows[1]["served_over_base"] == 2.0 and rows[1]["stock_over_served"] == 1.5
    with pytest.raises(ValueError, match="headline"):
        side_by_side.rows(_times(), {"base": 0, "cn1": 1}, steps=4, headline="mean")
