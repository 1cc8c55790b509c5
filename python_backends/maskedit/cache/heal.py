"""When a hit should heal its entry: shared by the engine (``runtime.CacheRuntime``) and the router's simulator,
so the simulator heals exactly when the engine does."""

from __future__ import annotations

import threading

import numpy as np

# A heal rewrites the whole entry: only when it spares later hits at least this fraction of the tokens.
HEAL_MIN_RATIO = 0.05


def worth_healing(heal: np.ndarray, min_ratio: float = HEAL_MIN_RATIO) -> bool:
    """``heal``: per image token, invalid in the entry and left unmasked by this hit (bool)."""
    return bool(heal.sum() >= max(1, min_ratio * heal.size))


class HealsInProgress:
    """Keys with a heal in progress: a heal rewrites the whole entry, so one at a time per key."""

    def __init__(self):
        self._keys: set[str] = set()
        self._mu = threading.Lock()

    def claim(self, key: str) -> bool:
        with self._mu:
            if key in self._keys:
                return False
            self._keys.add(key)
            return True

    def release(self, key: str) -> None:
        with self._mu:
            self._keys.discard(key)
