"""Temporary files of atomic writes into a directory shared by a host's model processes (the activation store's
tiers, the adapter cache's host tier): named ``.tmp-<pid>-<host>-<random>-<name>`` so an opening process removes
only the files of writers that died (or are very old), never the copy a live process is making. ``<host>`` (a digest
of the hostname) tells this host's writers from another's: pods on one node share the disk tier's hostPath, and
another pod's pid is not in this pod's /proc, so its files are removed only once stale."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
import uuid
from pathlib import Path

PREFIX = ".tmp-"
STALE_S = 600.0  # older than this: removed even if its pid is alive (a pid reused by another process)
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def tmp_path(directory: Path, name: str) -> Path:
    """Where a write of ``name`` into ``directory`` goes first, before its ``os.replace``."""
    return directory / f"{PREFIX}{os.getpid()}-{_HOST}-{uuid.uuid4().hex[:8]}-{name}"


def writer_alive(pid: str) -> bool:
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def sweep(directory: Path, now: float | None = None) -> None:
    """Remove ``directory``'s temporary files whose writer is gone or that are older than ``STALE_S``."""
    now = time.time() if now is None else now
    for p in directory.glob(f"{PREFIX}*"):
        parts = p.name[len(PREFIX):].split("-", 3)
        ours = len(parts) == 4 and parts[1] == _HOST
        with contextlib.suppress(OSError):
            stale = now - p.stat().st_mtime > STALE_S
            if stale or (ours and not writer_alive(parts[0])) or len(parts) < 4:
                p.unlink()
