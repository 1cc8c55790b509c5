"""Calibration writes a profile the router predicts with, without importing the model: the model's blocks travel
in it (Flux here; a UNet's per-level runs are written by the same code)."""

import json

import pytest

from maskedit_common.cost_model import CostModel
from maskedit_lab.engine import calibrate
from maskedit_router.__main__ import build
from maskedit_router.placement.features import EditFeatures
from maskedit_router.placement.policies import Estimator


def test_the_tiny_models_profile_carries_its_blocks_to_the_router(settings, tmp_path):
    out = tmp_path / "profile.json"
    calibrate.main(["--model-dir", str(settings.model_dir), "--steps", "2", "--out", str(out)])
    meta = json.loads(out.read_text())["meta"]
    assert meta["blocks"] == [["dual", 2, 256, 32], ["single", 2, 256, 32]]  # 2 + 2 blocks at 256 tokens
    assert meta["resolution"] == 256 and meta["grid_tokens"] == 256 and meta["text"] == 64
    est = Estimator(CostModel.load_file(out))
    assert est.blocks == [("dual", 2, 1.0, 32), ("single", 2, 1.0, 32)]
    f = EditFeatures("t", 0.2, 256, 2)
    assert 0 < est.request_ms(f, cached=True) <= est.request_ms(f, cached=False)
    router = build(["10.0.0.1:8001"], profile=out)
    assert router.resolution == 256  # masks measured on the grid the profile was calibrated at
    for b in router.backends.values():
        b.close()


def test_a_reference_row_models_profile_counts_its_reference_tokens(tmp_path):
    """FLUX.1 Kontext's blocks see 256 noisy + 256 reference tokens, all of them rows a hit plans over."""
    from maskedit.build_model import build as build_model

    model = build_model(tmp_path / "model", "kontext-tiny")
    out = tmp_path / "profile.json"
    calibrate.main(["--model-dir", str(model), "--steps", "2", "--out", str(out)])
    meta = json.loads(out.read_text())["meta"]
    assert meta["blocks"] == [["dual", 2, 512, 32], ["single", 2, 512, 32]] and meta["grid_tokens"] == 256
    assert meta["reference_tokens"] == 256
    est = Estimator(CostModel.load_file(out))  # a hit's masked tokens are a share of the image tokens only
    assert est.reference == 1.0 and est.blocks[0][2] == 2.0


def test_one_step_is_refused_by_name_it_would_time_nothing(capsys):
    """One step is the warm-up only: the profile came out with no block time at all (found by the device dry run)."""
    with pytest.raises(SystemExit):
        calibrate.main(["--steps", "1"])
    assert "--steps must be at least 2" in capsys.readouterr().err


def test_ratios_that_cannot_make_a_line_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        calibrate.main(["--ratios", "0.2", "0.2"])
    assert "--ratios must be at least two different mask ratios" in capsys.readouterr().err
