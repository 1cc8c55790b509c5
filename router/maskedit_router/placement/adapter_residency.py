"""Which LoRA adapters a backend likely holds, from the router's own routing history (as the template shadow of
its activation store): the adapters of the requests routed there, least recently routed dropped beyond ``slots``
or once ``expiry`` has passed. The cost model charges a cold load for each adapter of a request its backend does
not hold; the ``weighted`` policy's ``adapter`` scorer prefers backends holding them."""

from __future__ import annotations

from collections import OrderedDict

# A backend's host-memory adapter cache holds 2 GiB (maskedit.adapters.runtime): about 32 rank-64 adapters of a
# FLUX.1-size denoiser; the router assumes that many per backend.
DEFAULT_SLOTS = 32


class AdapterResidency:
    def __init__(self, slots: int = DEFAULT_SLOTS):
        self.slots = slots
        self._held: OrderedDict[str, float] = OrderedDict()  # name -> expiry (monotonic seconds), LRU order

    def holds(self, name: str, now: float) -> bool:
        exp = self._held.get(name)
        return exp is not None and exp > now

    def missing(self, names, now: float) -> int:
        """How many of ``names`` the backend would have to load."""
        return sum(not self.holds(n, now) for n in names)

    def share_held(self, names, now: float) -> float:
        """Fraction of ``names`` held (1 for a request without adapters: nothing to load anywhere)."""
        return 1.0 - self.missing(names, now) / len(names) if names else 1.0

    def touch(self, names, expiry: float) -> None:
        """``names`` were just routed here: the backend loads (or keeps) them."""
        for n in names:
            self._held[n] = expiry
            self._held.move_to_end(n)
        while len(self._held) > self.slots:
            self._held.popitem(last=False)

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
