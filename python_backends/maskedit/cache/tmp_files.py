"""Temporary files of atomic writes into a directory shared by a host's model processes (the activation store's
tiers, the adapter cache's host tier): named ``.tmp-<pid>-<random>-<name>`` so an opening process removes only the
files of writers that died (or are very old), never the copy a live process is making."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

PREFIX = ".tmp-"
STALE_S = 600.0  # older than this: removed even if its pid is alive (a pid reused by another process)


def tmp_path(directory: Path, name: str) -> Path:
    """Where a write of ``name`` into ``directory`` goes first, before its ``os.replace``."""
    return directory / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"


def writer_alive(pid: str) -> bool:
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def sweep(directory: Path, now: float | None = None) -> None:
    """Remove ``directory``'s temporary files whose writer is gone or that are older than ``STALE_S``."""
    now = time.time() if now is None else now
    for p in directory.glob(f"{PREFIX}*"):
        parts = p.name[len(PREFIX):].split("-", 2)
        pid = parts[0] if len(parts) == 3 else ""
        with contextlib.suppress(OSError):
            if not writer_alive(pid) or now - p.stat().st_mtime > STALE_S:
                p.unlink()
