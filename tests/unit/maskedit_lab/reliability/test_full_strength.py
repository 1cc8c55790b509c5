"""``make faults``'s measure of recovery: back to full strength, the hit rate included, not the first hit."""

from loadgen.records import Record
from maskedit_lab.reliability import faults, full_strength


def _recs(hits: list[bool], every_s: float = 0.5) -> list[Record]:
    return [Record(index=i, template=0, mask_ratio=0.1, arrival_s=i * every_s, submit_s=i * every_s,
                   done_s=i * every_s + 0.3, cache_hit=h) for i, h in enumerate(hits)]


def test_the_hit_rate_is_back_when_ten_requests_in_a_row_reach_the_target():
    recs = _recs([True] * 20 + [False] * 10 + [True, False] * 5 + [True] * 20)
    assert full_strength.hit_rate(recs, 0.0, 10.0) == 1.0
    back = full_strength.hit_rate_back_at(recs, since=10.0, target=0.9)
    assert back == recs[38].done_s  # 9 of the 10 from there: the sporadic hits before are not "back"
    assert full_strength.hit_rate_back_at(_recs([False] * 30), since=0.0, target=0.9) is None


def test_recovery_runs_to_the_later_of_full_strength_and_hits_back():
    recs = _recs([True] * 20 + [False] * 10 + [True] * 30)  # the fault at 10 s, over at 12 s
    case = {"injected_at_s": 10.0, "fault_detail": {"restored": 12.0}, "recovered_at_s": 14.0}
    r = faults.recovery(case, recs, "mem_fs_full")
    assert r["hit_rate_before"] == 1.0 and r["full_strength_after_s"] == 2.0
    assert r["recovery_s"] == r["hit_rate_back_after_s"] == round(recs[30].done_s - 12.0, 2)
    assert r["hit_rate_after"] == 1.0
    killed = faults.recovery(case, recs, "kill_denoise_stub")  # from the kill itself
    assert killed["recovery_s"] == round(recs[30].done_s - 10.0, 2)
    case["recovered_at_s"] = None  # never back to full strength: no recovery time
    assert faults.recovery(case, recs, "mem_fs_full")["recovery_s"] is None
