"""The lab command ``maskedit_lab.reliability.pacing``: the old repository it renders beside the served one, and
its summary. No server (the command itself starts two)."""

import re

from maskedit import repository
from maskedit_lab.reliability import pacing


def test_the_old_repository_is_the_served_one_without_intake_and_with_the_queue_policy(tmp_path):
    old = pacing.render_old(tmp_path / "old")
    assert not (old / "intake").exists()
    pre = (old / "preprocess" / "config.pbtxt").read_text()
    assert "max_queue_size: 16" in pre and "INTAKE_INFO" not in pre
    edit = (old / "edit" / "config.pbtxt").read_text()
    assert re.findall(r'model_name: "(\w+)"', edit) == ["preprocess", "masked_denoise", "vae_decode"]
    assert "INTAKE_INFO" not in edit and "intake" not in edit
    # everything else as served
    for rel, text in repository.render("cpu").items():
        if rel.split("/")[0] not in ("intake", "preprocess", "edit"):
            assert (old / rel).read_text() == text, rel
    assert (old / "preprocess" / "1" / "model.py").exists()


def test_the_summary_takes_medians_per_flood_and_the_worst_gap():
    run = lambda gap, p50: {"refusal_floods": [{"n": 24, "gap_median_s": gap / 10, "gap_max_s": gap,  # noqa: E731
                                                "last_after_s": 24 * gap}],
                            "latency": {"p50_s": p50, "p99_s": p50 * 2}}
    s = pacing.summarize({"old": [run(0.49, 1.0), run(0.5, 1.2), run(0.51, 1.1)], "new": [run(0.01, 1.0)]})
    assert s["old"]["refusals_24"]["gap_max_s"] == 0.5 and s["old"]["refusals_24"]["gap_max_s_worst"] == 0.51
    assert s["old"]["latency"] == {"p50_s": 1.1, "p99_s": 2.2} and s["new"]["refusals_24"]["gap_max_s"] == 0.01
