"""Weighted fair share of the denoise queue between tenants: who is admitted next, and who gives up a place when
the queue is full.

The router authenticates a caller and sets two request parameters on what it forwards (``maskedit_tenant``, the
tenant's name from the key file, and ``maskedit_tenant_weight``; never the key). The endpoint picker, which never
rewrites a gRPC body, sets headers instead (``x-maskedit-tenant``, ``x-maskedit-tenant-weight``) that Triton forwards
as parameters of those names (``maskedit_common.tenant_wire``); when they are there they win over the router's
names, which on that path only the client could have written. A request with neither (a direct client, the health
probe) belongs to the unnamed tenant ``""`` with weight 1, so a flood that bypasses the router shares one tenant's
place too.

- **Order**: start-time fair queueing, as the router's own queue (``maskedit_router.access.tenancy.FairQueue``): each
  request of a tenant of weight w gets a virtual finish tag 1/w past the larger of the tenant's previous tag and the
  queue's virtual time (the start tag of the last request admitted). The scheduler admits the smallest tag first
  among requests of equal slack, so a tenant that floods waits behind its own requests; within a tenant the tags
  grow with arrival (first come, first served). One tenant alone: tags in arrival order, today's behaviour.
- **Bound**: the queue keeps ``max_queue`` places. When it is full, a request whose tenant would hold less than
  the heaviest tenant's weighted share (requests waiting / weight) takes the place of that tenant's newest request
  (refused with RESOURCE_EXHAUSTED: an answer, never lost); otherwise it is refused itself. A light tenant is never
  starved by a full queue; the flood is refused, at once.
"""

from __future__ import annotations

import hashlib
import json
import re

from maskedit_common.tenant_wire import HEADERS, TENANT_HEADER, TENANT_PARAM, WEIGHT_HEADER, WEIGHT_PARAM

from .errors import InvalidInput, ResourceExhausted

_NAME = re.compile(r"^[A-Za-z0-9._-]{0,64}$")
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0


def tenant_of(parameters: str | dict | None) -> tuple[str, float]:
    """(tenant, weight) from a request's parameters (Triton gives the Python backend a JSON string): the picker's
    forwarded headers if present, else the router's parameters, else the unnamed tenant."""
    p = _parameters(parameters)
    if any(h in p for h in HEADERS):  # the picker's (a header is text: the weight is parsed here)
        tenant_key, weight_key = TENANT_HEADER, WEIGHT_HEADER
        weight = p.get(WEIGHT_HEADER, 1.0)
        if isinstance(weight, str):
            try:
                weight = float(weight)
            except ValueError:
                raise InvalidInput(f"must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}", WEIGHT_HEADER) from None
    else:
        tenant_key, weight_key = TENANT_PARAM, WEIGHT_PARAM
        weight = p.get(WEIGHT_PARAM, 1.0)
    name = p.get(tenant_key, "")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInput("must be a tenant name of at most 64 letters, digits or ._-", tenant_key)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise InvalidInput(f"must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}", weight_key)
    return name, float(weight)


def _parameters(parameters: str | dict | None) -> dict:
    """The parameters as a dict. Triton appends forwarded headers to the request's own parameters, so a header's
    name given twice with two values means the client sent it as a parameter too: refused, whichever copy comes
    first. (Twice the same value is the picker's own twice: a generate body it wrote, should Triton ever forward
    headers there as well.)"""
    if not isinstance(parameters, str):
        return parameters or {}
    pairs = json.loads(parameters, object_pairs_hook=lambda kv: kv)
    seen: dict = {}
    for k, v in pairs:
        if k in HEADERS and seen.get(k, v) != v:
            raise InvalidInput("is reserved for the gateway's header of that name; do not send it as a request "
                               "parameter", k)
        seen[k] = v
    return seen


def tenant_hash(name: str) -> int:
    """A tenant's 63-bit id on the shared-memory board (``maskedit.admission``); never 0 (an empty slot)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1 | 1


def loads(jobs) -> dict[str, float]:
    """Each tenant's weighted share of ``jobs``: requests / weight."""
    out: dict[str, float] = {}
    for j in jobs:
        out[j.tenant] = out.get(j.tenant, 0.0) + 1.0 / j.weight
    return out


class FairShare:
    """The denoise queue's tags and its displacement rule (called under the engine's lock). ``enabled=False``:
    tags stay 0 (the scheduler's arrival order) and a full queue refuses every newcomer, as before."""

    def __init__(self, enabled: bool = True, max_tenants: int = 1024):
        self.enabled, self.max_tenants = enabled, max_tenants
        self.vtime = 0.0
        self._finish: dict[str, float] = {}  # tenant -> finish tag of its last queued request

    def tag(self, job) -> None:
        if not self.enabled:
            return
        start = max(self.vtime, self._finish.get(job.tenant, 0.0))
        job.fair_tag = start + 1.0 / job.weight
        self._finish[job.tenant] = job.fair_tag

    def started(self, job, waiting=()) -> None:
        """``job`` left the queue for the batch: virtual time moves to its start tag. A tenant whose last tag is
        behind it is forgotten (its next request would start at the virtual time anyway); past ``max_tenants``
        remembered, so are those with nothing in ``waiting`` (at most one request's head start each), so the map
        stays bounded however many tenant names callers use."""
        if not self.enabled:
            return
        self.vtime = max(self.vtime, job.fair_tag - 1.0 / job.weight)
        present = {j.tenant for j in waiting} if len(self._finish) > self.max_tenants else None
        for t in [t for t, f in self._finish.items() if f <= self.vtime or (present is not None and t not in present)]:
            del self._finish[t]

    def make_room(self, waiting: list, job):
        """The queue is full and ``job`` arrives: the waiting request it displaces (the newest of the heaviest
        tenant, if that tenant's weighted share is larger than ``job``'s tenant's would be), else raises
        ResourceExhausted for ``job``."""
        if self.enabled and waiting:
            share = loads(waiting)
            heavy = max(share, key=share.get)
            mine = share.get(job.tenant, 0.0) + 1.0 / job.weight
            if heavy != job.tenant and share[heavy] > mine:
                return max((j for j in waiting if j.tenant == heavy), key=lambda j: (j.fair_tag, j.submitted_at))
        raise ResourceExhausted(f"denoise queue is full ({len(waiting)} waiting); retry later")
