"""Early admission: pre-processing refuses a request at once while the denoise queue is full.

The denoise loop refuses a request when its queue is full, but only after pre-processing (image decoding, the
VAE and text encoders) has been spent on it. When requests arrive faster than they can be served, they also wait
in Triton's queue in front of pre-processing, so a refusal could come seconds after the request was sent. The
denoise process publishes its queue length in a 16-byte shared-memory file per server (named after the
``tritonserver`` pid, the parent of both stubs); pre-processing reads it (a memory load) before any work and
refuses with RESOURCE_EXHAUSTED while the queue is full, which also keeps its own queue short.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path

from .errors import ResourceExhausted

# int64 fields, each written by one process only: waiting and max_queue (denoise: its queue), arrived (denoise:
# requests it has received), passed (pre-processing: requests it sent on towards denoise)
_WAITING, _MAX, _ARRIVED, _PASSED = 0, 8, 16, 24
_SIZE = 32


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
    def publish(self, waiting: int, max_queue: int) -> None:
        self._set(_WAITING, waiting)
        self._set(_MAX, max_queue)

    def arrived(self) -> None:
        self._set(_ARRIVED, self._get(_ARRIVED) + 1)

    # -- pre-processing -------------------------------------------------------------------------------------
    def queued(self) -> tuple[int, int]:
        """(requests waiting for denoise or on their way to it, the queue's limit)"""
        on_the_way = max(0, self._get(_PASSED) - self._get(_ARRIVED))
        return self._get(_WAITING) + on_the_way, self._get(_MAX)

    def check(self) -> None:
        """Raise ResourceExhausted while the denoise queue is full (limit 0: nothing published yet)."""
        queued, max_queue = self.queued()
        if max_queue > 0 and queued >= max_queue:
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
