"""The invalid-token rules the engine and the router's simulator share (``maskedit_common.heal``)."""

import numpy as np

from maskedit_common.heal import after_heal, cells, computed_tokens, heal_candidates, worth_healing


def grid_mask(h, w, *boxes):
    m = np.zeros((h, w), bool)
    for r0, r1, c0, c1 in boxes:
        m[r0:r1, c0:c1] = True
    return m.reshape(-1)


def test_flux_tokens_heal_outside_the_hits_own_mask():
    own, invalid = grid_mask(8, 8, (0, 8, 0, 2)), grid_mask(8, 8, (0, 8, 1, 4))
    heal = heal_candidates(own, invalid)
    assert (heal == (invalid & ~own)).all() and heal.sum() == 16
    assert (computed_tokens(own, invalid) == (own | invalid)).all()
    assert not (after_heal(invalid, heal) & ~own).any()
    assert worth_healing(heal, 0.25) and not worth_healing(heal, 0.3)


def test_cells_widen_a_mask_to_whole_cells_of_a_level():
    m = grid_mask(8, 8, (1, 2, 5, 6))  # one pixel
    assert (cells(m, (8, 8), 0) == m).all()
    assert (cells(m, (8, 8), 1) == grid_mask(8, 8, (0, 2, 4, 6))).all()
    assert (cells(m, (8, 8), 2) == grid_mask(8, 8, (0, 4, 4, 8))).all()


def test_unet_pixels_sharing_a_coarsest_cell_with_the_hits_edit_stay_invalid():
    """A UNet block at level 2 sees 4x4-pixel cells: an invalid pixel in a cell the hit edits is edited there."""
    own = grid_mask(8, 8, (0, 8, 5, 6))  # column 5: its level-2 cells are columns 4..7
    invalid = grid_mask(8, 8, (0, 8, 0, 1), (0, 8, 6, 8))  # columns 0, 6, 7
    heal = heal_candidates(own, invalid, (8, 8), 2)
    assert (heal == grid_mask(8, 8, (0, 8, 0, 1))).all()  # column 0 only: 6 and 7 share a cell with column 5
    assert (heal_candidates(own, invalid, (8, 8), 0) == (invalid & ~own)).all()
