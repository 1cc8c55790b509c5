"""Healing in the engine: the pure rules of invalid tokens (``maskedit_common.heal``, shared with the router's
simulator so it computes and heals exactly what the engine does) and the bookkeeping of heals in progress."""

from __future__ import annotations

import threading

from maskedit_common.heal import HEAL_MIN_RATIO, after_heal, computed_tokens, heal_candidates, worth_healing

__all__ = ["HEAL_MIN_RATIO", "HealsInProgress", "after_heal", "computed_tokens", "heal_candidates", "worth_healing"]


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
