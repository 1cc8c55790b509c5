"""The direct baseline's arithmetic: the ABBA plan that gives both paths the same schedule, the router hop as a
difference of percentiles, and the target judged on that hop."""

from types import SimpleNamespace

import numpy as np
import pytest

from maskedit_lab.routing.direct_baseline import (DIRECT, ROUTED, abba, added_ms, latency_fields, pct, segment_count,
                                                  split, summary, within_target, within_target_added)


def test_percentiles_are_numpys_linear_ones_and_none_without_samples():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert pct(xs, 50) == 3.0
    assert pct(xs, 99) == pytest.approx(4.96)  # interpolated between the two largest, not the largest
    assert pct([], 99) is None


def test_the_schedule_is_cut_into_windows_that_replay_every_request_once_at_its_own_offset():
    rng = np.random.default_rng(0)
    at = np.cumsum(rng.exponential(0.04, 500)).tolist()
    k = segment_count(at[-1], 5.0)
    parts = split(at, k)
    assert len(parts) == k and k % 2 == 0
    assert [i for part in parts for i, _ in part] == list(range(len(at)))  # each once, in order
    width = at[-1] / k
    for j, part in enumerate(parts):
        assert all(0.0 <= t <= width + 1e-9 for _, t in part)
        assert all(t + j * width == pytest.approx(at[i]) for i, t in part)  # the gaps between requests are kept


def test_segment_counts_are_even_and_abba_puts_each_path_first_equally_often():
    assert [segment_count(w, 5.0) for w in (1.0, 5.0, 10.0, 11.0, 20.0)] == [2, 2, 2, 4, 4]
    order = "".join(a[0] + b[0] for a, b in abba(4)).upper()
    assert order == "DRRDDRRD"
    firsts = [a for a, _ in abba(6)]
    assert firsts.count(DIRECT) == firsts.count(ROUTED) == 3
    # a linear drift (each block's position in the run) adds the same total to both paths over four blocks
    pos = {DIRECT: 0, ROUTED: 0}
    for j, pair in enumerate(abba(4)):
        for p, path in enumerate(pair):
            pos[path] += 2 * j + p
    assert pos[DIRECT] == pos[ROUTED]


def test_added_time_counts_answered_requests_only():
    sent = [SimpleNamespace(sent=0.0, done=0.030, service_s=0.020, error=None),
            SimpleNamespace(sent=0.0, done=0.5, service_s=None, error="LOST: no answer"),
            SimpleNamespace(sent=1.0, done=1.1, service_s=None, error=None)]  # answered without the instance's time
    assert added_ms(sent) == [pytest.approx(10.0)]


def test_the_hop_is_a_difference_of_percentiles_not_a_percentile_of_differences():
    direct = np.arange(1.0, 101.0)
    routed = np.random.default_rng(1).permutation(direct) + 2.0  # the same spread, shifted 2 ms, in another order
    f = latency_fields(direct.tolist(), routed.tolist())
    assert f["router_hop_ms_p50"] == pytest.approx(2.0)
    assert f["router_hop_ms_p99"] == pytest.approx(2.0)
    assert f["added_ms_p99"] == pytest.approx(np.percentile(routed, 99), abs=1e-3)  # routed, under its old name
    assert f["direct_added_ms_p99"] == pytest.approx(np.percentile(direct, 99), abs=1e-3)
    # negative control: pairing request by request would report a tail the router never added
    assert np.percentile(routed - direct, 99) > 50
    assert latency_fields([], [1.0])["router_hop_ms_p99"] is None


def _row(**kw):
    row = {"kind": "overhead", "instances": 32, "rate": 25, "errors": 0, "direct_errors": 0,
           "added_ms_p99": 31.0, "direct_added_ms_p99": 28.0, "router_hop_ms_p99": 3.0, "generator_kept_up": True}
    row.update(kw)
    return row


def test_the_target_is_judged_on_the_hop_and_the_old_rule_is_kept_beside_it():
    row = _row()  # the harness alone adds 28 ms; the router 3 ms of it
    assert within_target(row, 5.0)
    assert not within_target_added(row, 5.0)  # the earlier rule charged the router with all 31 ms
    assert not within_target(_row(router_hop_ms_p99=5.2), 5.0)
    assert not within_target(_row(direct_errors=1), 5.0)
    assert not within_target(_row(errors=2), 5.0)
    assert not within_target(_row(router_hop_ms_p99=None), 5.0)
    assert not within_target(_row(router_hop_ms_p99=-1.9), 5.0)  # the direct tail swamped it: unresolved


def test_the_summary_names_the_highest_rate_within_target_on_the_hop_per_instance_count():
    rows = []
    for n, rate, hop, kept in ((32, 25, 1.0, True), (32, 50, 4.0, True), (32, 100, 9.0, True),
                               (128, 25, 2.0, True), (128, 50, 3.0, False)):
        r = _row(instances=n, rate=rate, router_hop_ms_p99=hop, generator_kept_up=kept)
        r["within_target"], r["within_target_added"] = within_target(r, 5.0), within_target_added(r, 5.0)
        rows.append(r)
    rows.append({"kind": "policy", "instances": 32})
    s = summary(rows)
    assert s["32"] == {"emulated_instances": 32, "max_rate_hop_p99_within_target": 50,
                       "max_rate_added_p99_within_target": None}
    assert s["128"]["max_rate_hop_p99_within_target"] == 25  # 50 req/s: the generator fell behind
