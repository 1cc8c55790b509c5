"""The rules of an entry's invalid tokens (the ones its template run edited, which hold that edit, not the
template) and of healing them: pure functions shared by the engine (``maskedit.cache.decision`` / ``runtime``)
and the router's simulator (``maskedit_lab.router_sim``), so the simulator computes and heals exactly what the
engine does. Arguments are per image token, bool."""

from __future__ import annotations

import numpy as np

# A heal rewrites the whole entry: only when it spares later hits at least this fraction of the tokens.
HEAL_MIN_RATIO = 0.05


def computed_tokens(own: np.ndarray, invalid: np.ndarray) -> np.ndarray:
    """A hit computes its own masked tokens and every token its entry holds invalid."""
    return own | invalid


def heal_candidates(own: np.ndarray, invalid: np.ndarray) -> np.ndarray:
    """Invalid tokens a hit leaves unmasked: it computes them as template context, so its rows for them heal the
    entry (a hit from a stored entry; a follower's entry is still being written)."""
    return invalid & ~own


def after_heal(invalid: np.ndarray, healed: np.ndarray) -> np.ndarray:
    """The entry's invalid tokens once a heal of ``healed`` has been written."""
    return invalid & ~healed


def worth_healing(heal: np.ndarray, min_ratio: float = HEAL_MIN_RATIO) -> bool:
    """``heal``: per image token, invalid in the entry and left unmasked by this hit (bool)."""
    return bool(heal.sum() >= max(1, min_ratio * heal.size))
