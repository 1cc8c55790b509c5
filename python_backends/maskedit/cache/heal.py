"""When a hit should heal its entry: shared by the engine (``runtime.CacheRuntime``) and the router's simulator,
so the simulator heals exactly when the engine does."""

from __future__ import annotations

import numpy as np

# A heal rewrites the whole entry: only when it spares later hits at least this fraction of the tokens.
HEAL_MIN_RATIO = 0.05


def worth_healing(heal: np.ndarray, min_ratio: float = HEAL_MIN_RATIO) -> bool:
    """``heal``: per image token, invalid in the entry and left unmasked by this hit (bool)."""
    return bool(heal.sum() >= max(1, min_ratio * heal.size))
