"""The temporal benchmark's bookkeeping: the policies it measures and the compounding check of its summary."""

from maskedit_lab.engine.bench_temporal import CONTROLS, policies, request_controls, summary


def row(side, policy, speedup, preset="bench", family="flux_fill", ratio=0.2):
    return {"family": family, "preset": preset, "mask_ratio": ratio, "side": side, "policy": policy,
            "speedup": speedup, "computed_fraction": 0.6 if side in ("both", "temporal-only") else 1.0}


def test_the_step_mask_computes_the_asked_fraction():
    p = policies(10, 0.6, 0.1)
    assert len(p["step_mask"]["steps"]) == 6 and p["step_mask"]["steps"][0] == 0
    assert p["fbcache"] == {"policy": "fbcache", "threshold": 0.1} and p["taylorseer"]["order"] == 2


def test_summary_checks_compounding_and_the_flux_fill_target():
    rows = [row("full", "none", 1.0), row("mask-only", "none", 2.5), row("temporal-only", "step_mask", 1.55),
            row("both", "step_mask", 3.6), row("temporal-only", "fbcache", 1.2), row("both", "fbcache", 2.0)]
    (a, b) = summary(rows, 0.6)
    assert a["policy"] == "step_mask" and a["compound"] == round(3.6 / (2.5 * 1.55), 3)
    assert a["compound_target_met"] and a["speedup_target_met"]
    assert "compound_target_met" not in b  # the targets are the step mask's
    (c, _) = summary([dict(r, preset="klein-bench", family="flux2_klein") for r in rows], 0.6)
    assert "speedup_target_met" not in c  # 3.5x is Flux Fill's bench target


def test_a_flux_controlnet_preset_runs_a_controlnet_unless_told_otherwise():
    assert request_controls("flux_controlnet", "auto") == CONTROLS
    assert request_controls("flux_fill", "auto") is None and request_controls("flux_controlnet", "none") is None
    assert request_controls("unet_inpaint", '[{"name": "depth"}]') == [{"name": "depth"}]
