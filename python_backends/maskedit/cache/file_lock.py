"""An inter-process lock on a RAM-filesystem directory (``flock`` on a file in it): the activation store and the
adapter cache's host tier take it to evict and promote while other model processes of the host share the files."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path):
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
