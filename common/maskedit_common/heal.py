"""The rules of an entry's invalid tokens (the ones its template run edited, which hold that edit, not the
template) and of healing them: pure functions shared by the engine (``maskedit.cache.decision`` / ``runtime``)
and the router's simulator (``maskedit_lab.routing.sim``), so the simulator computes and heals exactly what the
engine does. Arguments are per image token, bool: a Flux token, or a UNet's latent pixel.

A UNet's blocks at level ``l`` see the latent grid halved ``l`` times: one of their tokens covers a cell of
``2**l`` pixels a side, and holds an edit if any pixel under it does. So on a UNet a hit's own edit reaches every
pixel that shares a cell of the coarsest level with it: those pixels stay invalid; only the others heal."""

from __future__ import annotations

import numpy as np

# A heal rewrites the whole entry: only when it spares later hits at least this fraction of the tokens.
HEAL_MIN_RATIO = 0.05


def computed_tokens(own: np.ndarray, invalid: np.ndarray) -> np.ndarray:
    """A hit computes its own masked tokens and every token its entry holds invalid."""
    return own | invalid


def cells(mask: np.ndarray, grid: tuple[int, int], level: int) -> np.ndarray:
    """``mask`` (h*w pixels) widened to whole cells of ``2**level`` pixels a side: all of a cell that has one."""
    h, w = grid
    f = 1 << level
    pooled = mask.reshape(h // f, f, w // f, f).any(axis=(1, 3))
    return np.repeat(np.repeat(pooled, f, axis=0), f, axis=1).reshape(-1)


def heal_candidates(own: np.ndarray, invalid: np.ndarray, grid: tuple[int, int] | None = None,
                    coarsest: int = 0) -> np.ndarray:
    """Invalid tokens a hit leaves unmasked: it computes them as template context, so its rows for them heal the
    entry (a hit from a stored entry; a follower's entry is still being written). On a UNet (``grid`` its latent
    grid, ``coarsest`` its deepest level with transformer blocks) only pixels outside its own edit's cells."""
    return invalid & ~(cells(own, grid, coarsest) if coarsest else own)


def after_heal(invalid: np.ndarray, healed: np.ndarray) -> np.ndarray:
    """The entry's invalid tokens once a heal of ``healed`` has been written."""
    return invalid & ~healed


def worth_healing(heal: np.ndarray, min_ratio: float = HEAL_MIN_RATIO) -> bool:
    """``heal``: per image token, invalid in the entry and left unmasked by this hit (bool)."""
    return bool(heal.sum() >= max(1, min_ratio * heal.size))
