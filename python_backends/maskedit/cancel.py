"""Cancelling requests that run inside the ``edit`` ensemble.

Triton 2.51 does not forward a client's cancel (or a closed stream) to a step of an ensemble, so the
denoise loop would finish work nobody waits for. Clients therefore also call the small ``cancel`` model
with the ids of the requests they abandon (the ensemble passes the client's request id to its steps);
it drops a marker file per id in a shared-memory directory, and the denoise loop checks the marker of
each running request at every step (a ``stat``, microseconds).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path

_SAFE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_AGE_S = 600.0


class CancelBoard:
    def __init__(self, directory: Path):
        """``directory``: ``Settings.service.cancel_dir``, the same for the ``cancel`` model and denoise."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def cancel(self, request_id: str) -> bool:
        if not _SAFE.match(request_id or ""):
            return False
        (self.dir / request_id).touch()
        return True

    def is_cancelled(self, request_id: str) -> bool:
        return bool(request_id) and _SAFE.match(request_id) is not None and (self.dir / request_id).exists()

    def clear(self, request_id: str) -> None:
        if request_id and _SAFE.match(request_id):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / request_id).unlink()

    def sweep(self, max_age_s: float = MAX_AGE_S) -> int:
        """Remove markers older than ``max_age_s`` (ids that never reached a denoise loop, or reached it after it
        had ended); returns how many."""
        now, n = time.time(), 0
        for p in self.dir.iterdir():
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > max_age_s:
                    p.unlink()
                    n += 1
        return n

    def sweep_every(self, interval_s: float = 60.0, max_age_s: float = MAX_AGE_S) -> threading.Event:
        """Sweep in a daemon thread every ``interval_s`` (markers must not wait for the next cancel call to be
        removed); set the returned event to stop it."""
        stop = threading.Event()

        def loop():
            while not stop.wait(interval_s):
                with contextlib.suppress(OSError):
                    self.sweep(max_age_s)

        threading.Thread(target=loop, daemon=True, name="cancel-sweeper").start()
        return stop
