import numpy as np
import pytest

from maskedit import samples


@pytest.mark.parametrize("shape", sorted(samples.SHAPES))
@pytest.mark.parametrize("ratio", [0.05, 0.11, 0.35, 0.6])
def test_mask_hits_requested_area(shape, ratio):
    m = samples.mask(384, 288, ratio, shape, seed=3)
    assert m.shape == (288, 384) and set(np.unique(m)) <= {0, 255}
    assert abs((m > 0).mean() - ratio) < 0.02
