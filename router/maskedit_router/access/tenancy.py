"""How much each caller may send: per-key limits (a token bucket of requests per second, requests in flight) and
a fair queue in front of the backends.

- ``Quotas``: ``enter(tenant)`` admits a request or raises ``OverLimit`` at once (429 / RESOURCE_EXHAUSTED with a
  ``Retry-After`` hint: when the bucket has a token again); ``leave`` when it ends. State is per key (a key's
  limits are its own), labelled by the tenant's name.
- ``FairQueue``: at most ``slots`` edits the router has sent are in the backends at once (so the backends' own
  first-come queues stay short); the rest wait here, at most ``max_wait_s``, and are let through in weighted fair
  order (start-time fair queueing: each request of a tenant of weight w advances the tenant's virtual finish tag
  by 1/w; the smallest tag goes first), so a tenant that floods waits behind its own requests, not in front of
  everyone's. ``fair=False``: the same queue first-come first-served (the comparison). A request that waits
  ``max_wait_s`` is refused (RESOURCE_EXHAUSTED): an answer, never lost.
- ``tag_request``: what the router forwards names the caller's tenant and weight (request parameters), so each
  backend's denoise queue shares itself between tenants too (``maskedit.fair_share``); the endpoint picker's path
  carries the same in headers (``maskedit_common.tenant_wire``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from maskedit_common.tenant_wire import HEADERS, TENANT_PARAM, WEIGHT_PARAM

from .auth import ANONYMOUS, Tenant


def tag_request(req, tenant: Tenant) -> None:
    """Set ``req``'s (a ModelInferRequest the router forwards) tenant parameters from the caller's key: the
    tenant's name and weight, never the key. With keys on, whatever the client put there is overwritten: a tenant
    is what its key says; parameters named as the picker's headers are removed (the backend would read those
    first). Open mode (no key file, ``ANONYMOUS``): nothing is known of the caller, so the request
    goes on as the client sent it (a client-named tenant, as a direct client's to a backend)."""
    if tenant is ANONYMOUS:
        return
    for name in HEADERS:
        if name in req.parameters:
            del req.parameters[name]
    req.parameters[TENANT_PARAM].string_param = tenant.name
    req.parameters[WEIGHT_PARAM].double_param = float(tenant.weight)


class OverLimit(Exception):
    """A request over its key's limits: refused at once. ``retry_after_s`` is the hint sent back."""

    def __init__(self, reason: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


def retry_after_header(seconds: float) -> str:
    """HTTP's ``Retry-After`` (whole seconds, at least 1)."""
    return str(max(1, math.ceil(seconds)))


def retry_after(message: str) -> str | None:
    """The ``Retry-After`` header of a refusal whose text says "retry after <s> s"."""
    m = RETRY_AFTER.search(message)
    return retry_after_header(float(m.group(1))) if m else None


RETRY_AFTER = re.compile(r"retry after ([0-9.]+) s")


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; ``take`` returns 0 when it took one, else the seconds until one."""

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.t = burst, now

    def take(self, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


@dataclass
class _KeyState:
    limits: tuple
    bucket: TokenBucket | None
    inflight: int = 0


class Quotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._state: dict[str, _KeyState] = {}
        self._lock = threading.Lock()

    def _of(self, t: Tenant, now: float) -> _KeyState:
        limits = (t.rps, t.burst)
        s = self._state.get(t.key_id)
        if s is None or s.limits != limits:  # new key, or its limits changed in a reload
            bucket = TokenBucket(t.rps, t.burst, now) if t.rps > 0 else None
            s = self._state[t.key_id] = _KeyState(limits, bucket, s.inflight if s else 0)
        return s

    def enter(self, t: Tenant) -> None:
        if not (t.rps or t.concurrent):
            return
        now = self.clock()
        with self._lock:
            s = self._of(t, now)
            if t.concurrent and s.inflight >= t.concurrent:
                raise OverLimit("concurrency", f"RESOURCE_EXHAUSTED: tenant {t.name} has {s.inflight} requests in "
                                f"flight, its key's limit (concurrent={t.concurrent}); retry after 1 s", 1.0)
            if s.bucket is not None:
                wait = s.bucket.take(now)
                if wait > 0:
                    raise OverLimit("rate", f"RESOURCE_EXHAUSTED: tenant {t.name} is over its key's rate (rps="
                                    f"{t.rps:g}, burst={t.burst:g}); retry after {wait:.2f} s", wait)
            s.inflight += 1

    def leave(self, t: Tenant) -> None:
        if not (t.rps or t.concurrent):
            return
        with self._lock:
            s = self._state.get(t.key_id)
            if s is not None and s.inflight > 0:
                s.inflight -= 1

    def inflight(self, t: Tenant) -> int:
        s = self._state.get(t.key_id)
        return s.inflight if s else 0


@dataclass(order=True)
class Waiter:
    tag: float
    seq: int
    tenant: Tenant = field(compare=False)
    grant: Callable[[], None] = field(compare=False)
    refuse: Callable[[str], None] = field(compare=False)
    deadline: float = field(compare=False, default=0.0)
    t0: float = field(compare=False, default=0.0)
    done: bool = field(compare=False, default=False)


class FairQueue:
    """``request(tenant, grant, refuse)``: ``grant()`` runs when the request may go to a backend (at once, on the
    caller's thread, when a slot is free and nobody waits), ``refuse(message)`` when it waited ``max_wait_s``;
    every granted request is ``release``d exactly once. ``slots`` may be a callable (e.g. per healthy backend).
    ``why_busy()``: why the slots are held, when there is more to say than a busy cluster (no backend up), for the
    refusal's text."""

    def __init__(self, slots, max_wait_s: float = 5.0, fair: bool = True,
                 clock: Callable[[], float] = time.monotonic, on_wait=None, why_busy: Callable[[], str] | None = None):
        self._slots = slots if callable(slots) else (lambda: slots)
        self.why_busy = why_busy
        self.max_wait_s, self.fair, self.clock = max_wait_s, fair, clock
        self.on_wait = on_wait  # on_wait(tenant, seconds, granted): metrics
        self.busy = 0
        self._heap: list[Waiter] = []
        self._finish: dict[str, float] = {}  # tenant -> virtual finish tag of its last queued request
        self._vtime = 0.0
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._expire_loop, daemon=True, name="router-fair-queue")
        self._thread.start()

    @property
    def slots(self) -> int:
        return max(1, int(self._slots()))

    def waiting(self) -> int:
        with self._cond:
            return sum(1 for w in self._heap if not w.done)

    def _tag(self, t: Tenant) -> float:
        if not self.fair:
            return float(next(self._seq))
        start = max(self._vtime, self._finish.get(t.name, 0.0))
        tag = start + 1.0 / t.weight
        self._finish[t.name] = tag
        return tag

    def request(self, tenant: Tenant, grant: Callable[[], None], refuse: Callable[[str], None]) -> Waiter:
        now = self.clock()
        with self._cond:
            w = Waiter(self._tag(tenant), next(self._seq), tenant, grant, refuse, now + self.max_wait_s, now)
            immediate = self.busy < self.slots and not any(not x.done for x in self._heap)
            if immediate:
                self.busy += 1
                w.done = True
                if self.fair:
                    self._vtime = max(self._vtime, w.tag - 1.0 / tenant.weight)
            else:
                heapq.heappush(self._heap, w)
                self._cond.notify_all()
        if immediate:
            if self.on_wait:
                self.on_wait(tenant, 0.0, True)
            grant()
        return w

    def cancel(self, w: Waiter) -> bool:
        """Take a waiting request out (its caller went away); False if it was granted or refused already."""
        with self._cond:
            if w.done:
                return False
            w.done = True
            return True

    def release(self) -> None:
        with self._cond:
            self.busy = max(0, self.busy - 1)
        self._dispatch()

    def _dispatch(self) -> None:
        granted = []
        with self._cond:
            while self._heap and self.busy < self.slots:
                w = heapq.heappop(self._heap)
                if w.done:
                    continue
                w.done = True
                self.busy += 1
                if self.fair:
                    self._vtime = max(self._vtime, w.tag - 1.0 / w.tenant.weight)
                granted.append(w)
            while self._heap and self._heap[0].done:
                heapq.heappop(self._heap)
        now = self.clock()
        for w in granted:
            if self.on_wait:
                self.on_wait(w.tenant, now - w.t0, True)
            w.grant()

    def expire(self, now: float | None = None) -> int:
        """Refuse the requests that waited ``max_wait_s``; returns how many."""
        now = self.clock() if now is None else now
        due = []
        with self._cond:
            for w in self._heap:
                if not w.done and w.deadline <= now:
                    w.done = True
                    due.append(w)
            if due:
                self._heap = [w for w in self._heap if not w.done]
                heapq.heapify(self._heap)
        why = self.why_busy() if self.why_busy and due else ""
        for w in due:
            if self.on_wait:
                self.on_wait(w.tenant, now - w.t0, False)
            w.refuse(f"RESOURCE_EXHAUSTED: waited {now - w.t0:.2f} s in the router's fair queue (tenant "
                     f"{w.tenant.name}, {self.busy} of {self.slots} backend slots busy{'; ' + why if why else ''}); "
                     f"retry after 1 s")
        return len(due)

    def _expire_loop(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                live = [w.deadline for w in self._heap if not w.done]
                timeout = max(0.005, min(live) - self.clock()) if live else None
                self._cond.wait(timeout)
                if self._stopped:
                    return
            self.expire()
            self._dispatch()  # slots may have grown (a backend came back)

    def wait(self, tenant: Tenant, timeout: float | None = None) -> str | None:
        """Blocking form for a caller on a thread of its own (a unary call): None when granted, else the refusal."""
        ev, why = threading.Event(), []
        self.request(tenant, ev.set, lambda m: (why.append(m), ev.set()))
        ev.wait(timeout)
        return why[0] if why else None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
