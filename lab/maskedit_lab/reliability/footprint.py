"""What a run leaves on the host: processes of a process group, their memory, /dev/shm bytes, listening ports.

Chaos and soak runs use these to check that nothing leaks (a reaped backend leaves no process, port or shared
memory region) and to sample every process's resident memory over time.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import psutil

from maskedit_lab.harness.supervisor import group_members

SHM = Path("/dev/shm")
__all__ = ["group_members", "label", "rss_by_process", "mapped_rss", "store_rss_by_process", "shm_regions",
           "dir_bytes", "port_in_use"]


def label(p: psutil.Process) -> str:
    """A stable name for a process: the Triton model a stub serves, else its program."""
    with contextlib.suppress(psutil.Error):
        cmd = p.cmdline()
        stub = next((a[:-4] for a in cmd if a.endswith("_0_0")), None)
        if stub:
            return f"stub:{stub}"
        if any("maskedit_router" in a for a in cmd):
            return "router"
        return p.name()
    return "?"


def rss_by_process(pgids: dict[str, int]) -> dict[str, int]:
    """Resident bytes of every live process in each named process group: ``{"<name>/<label>": rss}``."""
    out: dict[str, int] = {}
    for name, pgid in pgids.items():
        for p in group_members(pgid):
            with contextlib.suppress(psutil.Error):
                out[f"{name}/{label(p)}"] = out.get(f"{name}/{label(p)}", 0) + p.memory_info().rss
    return out


def mapped_rss(pid: int, dirs: list[Path]) -> int:
    """Resident bytes of ``pid``'s mappings of files under ``dirs`` (from /proc/<pid>/smaps; 0 where unreadable).

    RSS counts the pages of every mapped file a process has touched: for a denoise stub that includes the activation
    entries it has mapped (bounded by its store's mapping cap), which says nothing about a leak. Subtracting them
    leaves the memory that can leak: anonymous heap, tensors, interpreter objects."""
    prefixes = tuple(str(d).rstrip("/") + "/" for d in dirs)
    total, inside = 0, False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):  # a mapping's header: "start-end perms offset dev inode path"
                parts = line.split(None, 5)
                inside = len(parts) == 6 and parts[5].rstrip("\n").removesuffix(" (deleted)").startswith(prefixes)
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def store_rss_by_process(pgids: dict[str, int], dirs: list[Path]) -> dict[str, int]:
    """Like ``rss_by_process``, only the resident pages of mapped files under ``dirs`` (the store's tiers)."""
    out: dict[str, int] = {}
    for name, pgid in pgids.items():
        for p in group_members(pgid):
            key = f"{name}/{label(p)}"
            out[key] = out.get(key, 0) + mapped_rss(p.pid, dirs)
    return out


def shm_regions(prefix: str) -> list[str]:
    """Names of /dev/shm entries starting with ``prefix`` (a Triton server's Python-backend regions)."""
    return sorted(p.name for p in SHM.glob(f"{prefix}*"))


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_size
    return total


def port_in_use(port: int) -> bool:
    """True if something listens on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
