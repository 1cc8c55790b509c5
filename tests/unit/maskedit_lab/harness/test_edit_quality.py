"""The mask benchmarks' image-quality figures: identical images score perfectly, and a change inside the mask
shows more in the mask's own figures than in the whole image's."""

import numpy as np

from maskedit_lab.harness.edit_quality import quality


def test_the_mask_figures_see_a_change_the_whole_image_dilutes():
    rng = np.random.default_rng(0)
    full = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    m = np.zeros((64, 64), bool)
    m[8:24, 8:32] = True
    same = quality(full, full.copy(), m)
    assert same["ssim"] == same["ssim_mask_box"] == 1.0 and same["psnr_db"] == np.inf
    hit = full.copy()
    hit[10:20, 10:30] = rng.integers(0, 255, (10, 20, 3))
    q = quality(full, hit, m)
    assert q["ssim_mask_box"] < q["ssim"] < 1.0 and q["psnr_mask_db"] < q["psnr_db"]
