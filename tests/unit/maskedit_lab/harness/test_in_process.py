"""The benchmark harness's masks cover exact token ratios (the calibration and benchmarks rely on them)."""

import pytest

from maskedit_lab.harness.in_process import token_mask_image


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_benchmark_masks_have_exact_token_ratios(ratio):
    m = token_mask_image(32, 32, 16, ratio, seed=1)
    tokens = m.reshape(32, 16, 32, 16).max(axis=(1, 3)) > 0
    assert m.shape == (512, 512) and tokens.sum() == round(ratio * 1024)
