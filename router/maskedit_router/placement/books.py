"""The router's books on each backend (``BackendLoad``): requests and work in flight, the booked work and how much of
it the backend has worked off, and a shadow of its activation store (memory and disk tiers) and resident
checkpoints. A routed request's entry in them is a ``booking.Booking``. The router and the simulator book through
these same classes, so the simulated router keeps exactly the real one's books.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .adapter_residency import AdapterResidency

MEM, DISK = "mem", "disk"


@dataclass
class BackendLoad:
    """What the router knows about one backend: its books and a shadow of its store and resident checkpoints."""

    name: str
    inflight: int = 0
    masked_tokens: int = 0  # sum over in-flight requests
    work: int = 0  # outstanding work: masked tokens x steps, summed over in-flight requests
    backlog_ms: float = 0.0  # predicted work of in-flight requests, as booked
    # the store's memory tier as the router routed to it: template key -> expiry (monotonic seconds), LRU order
    templates: OrderedDict = field(default_factory=OrderedDict)
    disk: OrderedDict = field(default_factory=OrderedDict)  # the disk tier: what the memory tier evicted
    models: OrderedDict = field(default_factory=OrderedDict)  # resident checkpoints (LRU)
    adapters: AdapterResidency = field(default_factory=AdapterResidency)  # LoRA adapters routed here (LRU)
    healthy: bool = True
    mem_templates: int = 16  # the store's capacities in entries (its byte budgets / an entry's size)
    disk_templates: int = 64
    model_slots: int = 2  # checkpoints resident at once
    drained_ms: float = 0.0  # booked work worked off since (``backlog_at``)
    drain_t: float | None = None

    def tier(self, key: str | None, now: float) -> str | None:
        """Where the backend likely holds ``key``'s entry: ``mem``, ``disk`` or None."""
        if not key:
            return None
        exp = self.templates.get(key)
        if exp is not None and exp > now:
            return MEM
        exp = self.disk.get(key)
        return DISK if exp is not None and exp > now else None

    def holds(self, key: str | None, now: float) -> bool:
        return self.tier(key, now) is not None

    def holds_model(self, model: str | None) -> bool:
        return model is None or model in self.models

    def touch(self, key: str | None, expiry: float) -> None:
        """``key`` was just routed here: its entry will be (or is) in the memory tier."""
        if not key:
            return
        self.disk.pop(key, None)
        self.templates[key] = expiry
        self.templates.move_to_end(key)
        while len(self.templates) > self.mem_templates:
            old, exp = self.templates.popitem(last=False)
            self.disk[old] = exp
        while len(self.disk) > self.disk_templates:
            self.disk.popitem(last=False)

    def touch_model(self, model: str | None) -> None:
        if model is None:
            return
        self.models[model] = True
        self.models.move_to_end(model)
        while len(self.models) > self.model_slots:
            self.models.popitem(last=False)

    def forget(self) -> None:
        """Its caches are no longer trusted (it failed)."""
        self.templates.clear()
        self.disk.clear()
        self.models.clear()
        self.adapters.clear()

    def utilisation(self) -> float:
        """Fill of the store's memory tier (what llm-d's kv-cache utilisation scorer reads from a pod)."""
        return min(1.0, len(self.templates) / max(1, self.mem_templates))

    def backlog_at(self, now: float) -> float:
        """Booked work less what the backend has worked off since (1 ms per ms while it has work)."""
        self._drain(now)
        return max(0.0, self.backlog_ms - self.drained_ms)

    def _drain(self, now: float) -> None:
        if self.drain_t is not None and now > self.drain_t:
            self.drained_ms = min(self.backlog_ms, self.drained_ms + (now - self.drain_t) * 1000.0)
        self.drain_t = now
