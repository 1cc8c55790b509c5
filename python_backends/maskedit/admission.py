"""Early admission: pre-processing refuses a request at once while the denoise queue is full.

The denoise loop refuses a request when its queue is full, but only after pre-processing (image decoding, the
VAE and text encoders) has been spent on it. When requests arrive faster than they can be served, they also wait
in Triton's queue in front of pre-processing, so a refusal could come seconds after the request was sent. The
denoise process publishes its queue length in a 16-byte shared-memory file per server (named after the
``tritonserver`` pid, the parent of both stubs); pre-processing reads it (a memory load) before any work and
refuses with RESOURCE_EXHAUSTED while the queue is full, which also keeps its own queue short.

With tenants (``maskedit.fair_share``) a full queue still takes a request whose tenant holds less than the
heaviest tenant's share (it displaces that tenant's newest), so the board also carries the weighted share of the
``SLOTS`` heaviest tenants, and the check lets a lighter tenant's request through while the heaviest is refused.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path

from .errors import ResourceExhausted
from .fair_share import tenant_hash

# int64 fields, each written by one process only: waiting and max_queue (denoise: its queue), arrived (denoise:
# requests it has received), passed (pre-processing: requests it sent on towards denoise); then (denoise) the
# heaviest tenants' shares: SLOTS pairs of (tenant hash, share x 1000), 0 = an empty slot
_WAITING, _MAX, _ARRIVED, _PASSED = 0, 8, 16, 24
_SHARES, SLOTS = 32, 16
_SIZE = _SHARES + 16 * SLOTS


def board_path(directory: Path, server_pid: int | None = None) -> Path:
    """The board of server ``server_pid`` (default: this stub's parent, the ``tritonserver``) in ``directory``
    (``Settings.service.admission_dir``)."""
    return Path(directory) / f"server-{server_pid if server_pid is not None else os.getppid()}"


class QueueBoard:
    """The denoise queue as the denoise process last published it, shared with pre-processing. Requests that
    pre-processing has passed but denoise has not received yet count as queued: a burst is admitted only as far
    as the queue has room, so the rest are refused before pre-processing rather than after it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    def _get(self, off: int) -> int:
        return struct.unpack_from("<q", self._map, off)[0]

    def _set(self, off: int, value: int) -> None:
        struct.pack_into("<q", self._map, off, value)

    # -- the denoise process ----------------------------------------------------------------------------
    def publish(self, waiting: int, max_queue: int, shares: dict[str, float] | None = None) -> None:
        """The queue's length and limit, and (fair share on) each tenant's weighted share of it."""
        heaviest = sorted((shares or {}).items(), key=lambda kv: -kv[1])[:SLOTS]
        for i in range(SLOTS):
            h, v = (tenant_hash(heaviest[i][0]), round(heaviest[i][1] * 1000)) if i < len(heaviest) else (0, 0)
            self._set(_SHARES + 16 * i, h)
            self._set(_SHARES + 16 * i + 8, v)
        self._set(_WAITING, waiting)
        self._set(_MAX, max_queue)

    def arrived(self) -> None:
        self._set(_ARRIVED, self._get(_ARRIVED) + 1)

    # -- pre-processing -------------------------------------------------------------------------------------
    def queued(self) -> tuple[int, int]:
        """(requests waiting for denoise or on their way to it, the queue's limit)"""
        on_the_way = max(0, self._get(_PASSED) - self._get(_ARRIVED))
        return self._get(_WAITING) + on_the_way, self._get(_MAX)

    def shares(self) -> dict[int, float]:
        """Tenant hash -> weighted share of the queue, for the heaviest tenants (empty: fair share off)."""
        out = {}
        for i in range(SLOTS):
            h = self._get(_SHARES + 16 * i)
            if h:
                out[h] = self._get(_SHARES + 16 * i + 8) / 1000
        return out

    def check(self, tenant: str = "", weight: float = 1.0) -> None:
        """Raise ResourceExhausted while the denoise queue is full (limit 0: nothing published yet), unless
        ``tenant`` would hold less of it than the heaviest tenant (denoise then gives it that tenant's place)."""
        queued, max_queue = self.queued()
        if max_queue > 0 and queued >= max_queue:
            shares = self.shares()
            mine = shares.get(tenant_hash(tenant), 0.0) + 1.0 / weight
            if not shares or max(shares.values()) <= mine:
                raise ResourceExhausted(f"denoise queue is full ({queued} waiting); retry later")

    def passed(self) -> None:
        self._set(_PASSED, self._get(_PASSED) + 1)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


def remove(directory: Path, server_pid: int) -> None:
    """Remove a server's board (the launcher does, when it stops or reaps the server)."""
    with contextlib.suppress(FileNotFoundError):
        board_path(directory, server_pid).unlink()
