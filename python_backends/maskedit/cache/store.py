"""The activation store: a host-memory tier shared by processes, LRU-evicted to a disk tier.

(Over 400 lines on purpose: the tiers' budgets, eviction, promotion and their recovery share one inter-process lock
and the same fault handling; the file format, checksums and tier health live in their own modules.)

Each entry is one safetensors file (``entry_file``: one template's recorded activations plus JSON metadata with a
checksum per chunk). The memory tier is a directory on a RAM filesystem (``/dev/shm`` by default), so every Triton
model process can map the same bytes without copying: preprocess checks and prefetches, masked_denoise reads and
records.

Integrity (``integrity``): no byte reaches a computation unverified. Opening an entry checks its structure and
the small arrays a decision reads; the loader verifies each block's rows as it copies them, promotion and heals
verify the whole entry. A mismatch discards the file (``invalidate``), counts it and logs it; its request is
recomputed in full.
Crash safety: a writer fills a hidden temporary file and ``os.replace``-s it into place, so an entry is visible
only when complete; a writer killed mid-way leaves only a temporary file, swept later. Two processes recording the
same key each write a complete file and the last rename wins. LRU order is the file's access time (set on every
open); eviction moves the oldest memory entries to disk under an inter-process lock, on every write and when the
store is opened (a restart with a smaller budget applies it at once); promotion copies a disk entry back (optionally
in a thread while the request still queues).
Storage faults (``TierHealth``): budgets hold whatever the filesystems do. Room is made before a write; an entry
that cannot move to an unwritable or full disk tier is dropped instead of kept over budget; a memory tier that
cannot make room refuses new entries; ``ENOSPC`` shrinks the memory tier's budget to what its filesystem held, and
the budget never starts above the filesystem's free space. Errors in background work are caught, logged once per
kind with context, counted, and shown as a degraded tier until that tier's next success. Recovery (``probe``, run
every few seconds by each process): a shrunk budget grows back to the configured one once its filesystem has the
room again, and a degraded tier is cleared once a probe write succeeds, not only at its next real write. Eviction
verifies an entry before copying it to the disk tier: a corrupt one is discarded, never carried on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .. import logs
from . import entry_file, integrity, tier_health, tmp_files
from .entry_file import Entry, MappedArrays, as_tensor, open_file
from .file_lock import locked
from .integrity import CorruptEntry
from .tier_health import TierHealth

__all__ = ["ActivationStore", "CorruptEntry", "Entry", "MappedArrays", "as_tensor", "from_settings", "open_file"]

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
MAPPED_CAP = 64  # entries a process keeps mapped for reuse (requests in flight hold their own on top)
# The disk tier never takes more than this share of the space its filesystem has (free plus what the tier holds):
# a fixed cap alone would fill a small disk.
DISK_FREE_FRACTION = 0.5
_HEADER_ROOM = 256  # per array: its header record and alignment
_OS_ERROR = re.compile(r"os error (\d+)")  # safetensors' I/O error text
_ENOSPC_SHRINK = 0.9  # after ENOSPC the memory budget is this share of what its filesystem can hold


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    corrupt: int = 0
    inserts: int = 0
    heals: int = 0  # entries rewritten with tokens another request had edited recomputed as template context
    dropped: int = 0  # evicted from the disk tier (gone), or from memory when the disk tier could not take them
    refused: int = 0  # new entries not written: the memory tier could not make room for them
    errors: int = 0  # storage errors caught (a tier that could not write, delete or copy)
    recovered: int = 0  # a degraded tier healthy again (a real write or a probe), a shrunk budget back in full
    # CPU seconds of the background writes (a template run's entry, a heal's rewrite): work that competes with the
    # denoise loop for the host's cores, reported so capacity models can charge it.
    record_cpu_s: float = 0.0
    heal_cpu_s: float = 0.0
    extra: dict = field(default_factory=dict)


class ActivationStore:
    def __init__(self, mem_dir: str | Path, disk_dir: str | Path, mem_bytes: int, disk_bytes: int,
                 disk_free_fraction: float = DISK_FREE_FRACTION):
        self.mem_dir, self.disk_dir = Path(mem_dir), Path(disk_dir)
        self.disk_bytes = int(disk_bytes)
        self.disk_free_fraction = disk_free_fraction
        for d in (self.mem_dir, self.disk_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.stats = StoreStats()
        self.health = TierHealth(self.stats)
        self._mapped: dict[tuple, Entry] = {}  # entries this process has mapped, by (path, inode, size, mtime_ns)
        self._promoting: dict[str, threading.Thread] = {}
        self._mu = threading.Lock()
        self.configured_mem_bytes = int(mem_bytes)  # what a shrunk budget grows back to (``probe``)
        self.mem_bytes = self._fit_to_filesystem(int(mem_bytes))
        self._sweep_tmp()
        self._fit_on_open()

    def _fit_on_open(self) -> None:
        """Bring both tiers within their budgets now, as a write would: a restart with a smaller
        MASKEDIT_CACHE_MEM_BYTES (or _DISK_BYTES) must not keep the old amount in /dev/shm until the next write, which
        a host whose templates are all cached may not make (a sized /dev/shm: ENOSPC, or the pod OOM-killed). Under
        the inter-process lock, so processes opening at once shrink the tiers once between them. Storage errors are
        logged and counted, never raised (the store is an optimisation)."""
        before = (self.stats.evictions, self.stats.dropped)
        try:
            with self._lock():
                held = self.tier_bytes()
                fits = self._evict_locked(0)
                now = self.tier_bytes()
        except OSError as e:
            self.stats.errors += 1
            logs.event(log, "activation store could not apply its budgets on open", logging.WARNING,
                       error=type(e).__name__, detail=str(e)[:200], dir=str(self.mem_dir))
            return
        demoted, dropped = self.stats.evictions - before[0], self.stats.dropped - before[1]
        if demoted or dropped or not fits:
            logs.event(log, "activation store brought within its budgets on open",
                       logging.INFO if fits else logging.WARNING, demoted=demoted, dropped=dropped,
                       mem_bytes_before=held["mem"], mem_bytes=now["mem"], mem_budget=self.mem_bytes,
                       disk_bytes_before=held["disk"], disk_bytes=now["disk"],
                       disk_budget=self.disk_limit(now["disk"]), within_budget=fits)

    def _fit_to_filesystem(self, budget: int) -> int:
        """The memory tier's budget: the configured one, never above what its filesystem can hold (free space plus
        what the tier holds already); a RAM filesystem smaller than the budget would otherwise fill and freeze."""
        room = self._mem_room()
        if room is None:
            return budget
        if room < budget:
            logs.event(log, "activation memory tier budget reduced to its filesystem's free space",
                       logging.WARNING, configured=budget, budget=room, dir=str(self.mem_dir))
            return room
        return budget

    def _mem_room(self) -> int | None:
        """What the memory tier's filesystem can hold for it: its free space plus the tier's entries."""
        try:
            return shutil.disk_usage(self.mem_dir).free + sum(s.st_size for _, s in self.entries("mem"))
        except OSError:
            return None

    # -- recovery -----------------------------------------------------------------------------------
    def probe(self) -> None:
        """Bring back what a storage fault took once the fault is gone (called every few seconds): a memory budget
        shrunk after ENOSPC grows back towards the configured one as its filesystem has room again (in full when
        it has room for all of it), and a degraded tier whose probe write succeeds is healthy again. Costs nothing
        while every tier is healthy at its full budget. Never raises."""
        if self.mem_bytes < self.configured_mem_bytes:
            self._regrow_budget()
        for tier, d in (("mem", self.mem_dir), ("disk", self.disk_dir)):
            if not [op for op in self.health.failing(tier) if op != tier_health.BUDGET]:
                continue
            try:
                tier_health.probe_write(d)
                if tier == "mem" and not self.evict():  # and it is within its budget (an entry it could not delete)
                    continue
            except OSError:
                continue
            self.health.probed_ok(tier)

    def _regrow_budget(self) -> None:
        room = self._mem_room()
        if room is None:
            return
        target = self.configured_mem_bytes if room >= self.configured_mem_bytes else int(room * _ENOSPC_SHRINK)
        if target <= self.mem_bytes:
            return
        before, self.mem_bytes = self.mem_bytes, target
        full = target >= self.configured_mem_bytes
        logs.event(log, "activation memory tier budget restored" if full else "activation memory tier budget grown",
                   budget=target, before=before, configured=self.configured_mem_bytes, room=room)
        if full:
            self.health.ok("mem", tier_health.BUDGET, how="probe")

    # -- paths and locking --------------------------------------------------------------------------
    def _path(self, tier_dir: Path, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad cache key {key!r}")
        return tier_dir / f"{key}{SUFFIX}"

    def _lock(self):
        """Inter-process lock for eviction and promotion (flock on a file in the memory tier)."""
        return locked(self.mem_dir / ".lock")

    def _sweep_tmp(self) -> None:
        # a live writer's file stays: another process opening the store (e.g. at once with this one) would
        # otherwise delete the copy an eviction is making, and lose the entry
        for d in (self.mem_dir, self.disk_dir):
            tmp_files.sweep(d)

    # -- queries ------------------------------------------------------------------------------------
    def locate(self, key: str) -> str | None:
        """'mem', 'disk' or None, without opening or counting a hit."""
        if self._path(self.mem_dir, key).exists():
            return "mem"
        if self._path(self.disk_dir, key).exists():
            return "disk"
        return None

    def entries(self, tier: str = "mem") -> list[tuple[Path, os.stat_result]]:
        d = self.mem_dir if tier == "mem" else self.disk_dir
        out = []
        for p in d.glob(f"*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                out.append((p, p.stat()))
        return out

    def tier_bytes(self) -> dict[str, int]:
        return {t: sum(s.st_size for _, s in self.entries(t)) for t in ("mem", "disk")}

    def metrics(self) -> dict:
        b = self.tier_bytes()
        s = self.stats
        return {"hits": s.hits, "misses": s.misses, "evictions": s.evictions, "promotions": s.promotions,
                "corrupt": s.corrupt, "inserts": s.inserts, "heals": s.heals, "dropped": s.dropped,
                "refused": s.refused, "errors": s.errors,
                "record_cpu_s": s.record_cpu_s, "heal_cpu_s": s.heal_cpu_s, "mem_bytes": b["mem"],
                "disk_bytes": b["disk"], "mem_entries": len(self.entries("mem")),
                "disk_entries": len(self.entries("disk")), "mem_budget": self.mem_bytes,
                "mem_budget_configured": self.configured_mem_bytes, "recovered": s.recovered,
                "degraded": dict(self.health.degraded)}

    # -- reads --------------------------------------------------------------------------------------
    def open(self, key: str, promote: bool = True, count: bool = True) -> Entry | None:
        """The entry for ``key`` from the memory tier (promoting it from disk first), or None (a miss).
        ``count=False``: a second look for the same request (not another hit or miss in the stats)."""
        self.wait_promotion(key)
        path = self._path(self.mem_dir, key)
        if not path.exists() and promote and self._path(self.disk_dir, key).exists():
            self.promote(key)
        entry = self._open_path(path, key, "mem")
        if entry is None:
            self.stats.misses += count
            return None
        self.stats.hits += count
        self._touch(path)
        return entry

    def current(self, key: str) -> Entry | None:
        """The entry in the memory tier now (the same object as an earlier ``open`` while the file is unchanged),
        without promoting or counting a hit."""
        return self._open_path(self._path(self.mem_dir, key), key, "mem")

    @staticmethod
    def _touch(path: Path) -> None:
        """LRU order is the access time, set explicitly (mtime stays the write time: it identifies content)."""
        with contextlib.suppress(OSError):
            st = path.stat()
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))

    def _open_path(self, path: Path, key: str, tier: str) -> Entry | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        ident = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        entry = self._mapped.get(ident)
        try:
            if entry is not None:  # the same file as last time: its small arrays again (a decision reads them)
                for name, a in entry.arrays.items():
                    if a.nbytes <= entry_file.SMALL_BYTES:
                        entry.verify(name)
                return entry
            info, arrays, size = open_file(path, verify=False)
        except (CorruptEntry, ValueError, OSError) as e:
            self._discard(path, ident, f"{e}", tier)
            return None
        entry = Entry(key=key, path=path, tier=tier, meta=info, arrays=arrays, nbytes=size, dtypes=arrays.dtypes,
                      mapping=arrays.mapping, ident=ident)
        self._unmap_stale()
        if len(self._mapped) >= MAPPED_CAP:
            self._mapped.pop(next(iter(self._mapped)))
        self._mapped[ident] = entry
        return entry

    def _unmap_stale(self) -> None:
        """Forget mapped entries whose file was replaced (a heal), evicted or deleted. On a RAM filesystem an
        unlinked file's pages live as long as a mapping does, so keeping them would hold memory outside the tier's
        budget (requests still using such an entry keep their own reference until they finish)."""
        for ident in list(self._mapped):
            path, ino, size, mtime = ident
            try:
                st = os.stat(path)
                current = (st.st_ino, st.st_size, st.st_mtime_ns) == (ino, size, mtime)
            except FileNotFoundError:
                current = False
            if not current:
                self._mapped.pop(ident, None)

    def invalidate(self, entry: Entry, why: str) -> None:
        """A reader found ``entry`` corrupt: discard its file (if it is still that file: a rewrite since is not
        touched) and forget its mapping."""
        self._discard(entry.path, entry.ident, why, entry.tier)

    def _discard(self, path: Path, ident: tuple | None, why: str, tier: str) -> None:
        self.stats.corrupt += 1
        logs.event(log, "corrupt activation entry discarded", logging.WARNING, key=path.stem, tier=tier,
                   reason=why[:300])
        self._mapped.pop(ident, None)
        with contextlib.suppress(OSError):
            st = path.stat()
            if ident is None or (st.st_ino, st.st_size, st.st_mtime_ns) == ident[1:]:
                path.unlink()

    # -- writes -------------------------------------------------------------------------------------
    def put(self, key: str, arrays: dict, meta: dict) -> Path | None:
        """Write an entry atomically into the memory tier, room made for it first. ``arrays`` are numpy arrays or
        CPU tensors; tensors keep their dtype (bf16/fp16 entries of a bf16/fp16 model). Returns its path, or None
        when the memory tier cannot hold it (refused: counted, the tier shown degraded)."""
        arrays = {k: (v.detach().contiguous() if isinstance(v, torch.Tensor) else
                      torch.from_numpy(np.ascontiguousarray(v))) for k, v in arrays.items()}
        info = dict(meta, hash=integrity.ALGO, chunks=integrity.table(arrays), key=key, created=time.time())
        # The file's size: the arrays, and a header holding the metadata JSON escaped inside JSON (at most twice).
        need = sum(a.numel() * a.element_size() for a in arrays.values()) + 2 * len(json.dumps(info)) + \
            _HEADER_ROOM * len(arrays)
        for attempt in range(2):
            # An entry larger than the whole memory tier goes straight to the disk tier (its home after eviction).
            tier, d = ("mem", self.mem_dir) if need <= self.mem_bytes else ("disk", self.disk_dir)
            path = self._path(d, key)
            if tier == "mem" and not self.evict(room=need):
                self.stats.refused += 1
                self.health.failed("mem", "admit", MemoryError(f"no room for {need} bytes within its budget of "
                                                               f"{self.mem_bytes}"), key=key)
                return None
            try:
                self._write(path, arrays, info)
                break
            except OSError as e:
                self.health.failed(tier, "write", e, key=key)
                if e.errno != errno.ENOSPC or attempt or tier != "mem":
                    self.stats.refused += 1
                    return None
                # The filesystem holds less than the budget (another user, a smaller tmpfs): keep to what it has
                # room for, the tier's entries plus its free space, with a margin for writes in flight.
                held = self.tier_bytes()["mem"]
                try:
                    free = shutil.disk_usage(self.mem_dir).free
                except OSError:
                    free = 0
                self.mem_bytes = min(self.mem_bytes, max(0, int((held + free) * _ENOSPC_SHRINK)))
                logs.event(log, "activation memory tier budget shrunk after ENOSPC", logging.WARNING,
                           budget=self.mem_bytes, held=held, free=free)
                # degraded until ``probe`` finds the room again and the budget is back in full
                self.health.failed("mem", tier_health.BUDGET, e, count=False, budget=self.mem_bytes,
                                   configured=self.configured_mem_bytes)
        self.health.ok(tier, "write")
        self.health.ok("mem", "admit")
        self.stats.inserts += 1
        self.evict()
        return path

    def _write(self, path: Path, arrays: dict, info: dict) -> None:
        tmp = tmp_files.tmp_path(path.parent, path.stem)
        try:
            try:
                save_file(arrays, str(tmp), metadata={"maskedit": json.dumps(info)})
            except SafetensorError as e:  # its I/O errors are not OSErrors: say which errno, as the OS did
                m = _OS_ERROR.search(str(e))
                raise OSError(int(m.group(1)) if m else errno.EIO, str(e), str(tmp)) from None
            os.replace(tmp, path)  # the entry becomes visible complete, or not at all
            # LRU order must come from one clock: the filesystem stamps a new file with a coarse (jiffy) time,
            # which can sort before a touch made a moment earlier with the fine one.
            self._touch(path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def delete(self, key: str) -> None:
        for d in (self.mem_dir, self.disk_dir):
            with contextlib.suppress(FileNotFoundError):
                self._path(d, key).unlink()

    def evict(self, room: int = 0) -> bool:
        """Move least recently used memory entries to disk until the memory tier fits with ``room`` bytes to
        spare; trim the disk tier. An entry the disk tier cannot take is dropped (its budget holds). False if the
        memory tier could not be brought within budget (an entry could not be deleted)."""
        with self._lock():
            return self._evict_locked(room)

    def _evict_locked(self, room: int) -> bool:
        """``evict`` with the inter-process lock held by the caller."""
        mem = sorted(self.entries("mem"), key=lambda e: e[1].st_atime_ns)
        total = sum(s.st_size for _, s in mem)
        for p, s in mem:
            if total + room <= self.mem_bytes:
                break
            moved = self._to_disk(p)
            if moved == "disk":
                self.stats.evictions += 1
            elif moved == "dropped":
                self.stats.dropped += 1
            if not self._remove(p, "mem"):  # (a corrupt one is gone already: discarded and counted)
                continue
            total -= s.st_size
        self._trim_disk()
        return total + room <= self.mem_bytes

    def _remove(self, p: Path, tier: str) -> bool:
        """Delete an entry file of ``tier``; False (the failure counted, the tier shown degraded) if it stays."""
        try:
            p.unlink()
        except FileNotFoundError:
            return True
        except OSError as e:
            self.health.failed(tier, "delete", e, entry=p.name)
            return False
        self.health.ok(tier, "delete")
        return True

    def _to_disk(self, p: Path) -> str:
        """Copy memory entry ``p`` to the disk tier, verified first: ``disk`` (copied), ``dropped`` (the disk tier
        could not take it), ``gone`` (moved by another process meanwhile) or ``corrupt`` (discarded: counted and logged, never carried to disk, where it would be
        found only at its promotion)."""
        try:
            st = p.stat()
            open_file(p, verify=True)
        except FileNotFoundError:  # another process moved it meanwhile
            return "gone"
        except (CorruptEntry, ValueError) as e:
            self._discard(p, (str(p), st.st_ino, st.st_size, st.st_mtime_ns), f"found at eviction: {e}", "mem")
            return "corrupt"
        except OSError as e:
            self.health.failed("mem", "read", e, entry=p.name)
            return "dropped"
        try:
            self._copy_atomic(p, self.disk_dir / p.name)
        except OSError as e:
            self.health.failed("disk", "write", e, entry=p.name)
            return "dropped"
        self.health.ok("disk", "write")
        return "disk"

    def _trim_disk(self) -> None:
        disk = sorted(self.entries("disk"), key=lambda e: e[1].st_atime_ns)
        total = sum(s.st_size for _, s in disk)
        limit = self.disk_limit(total)
        for p, s in disk:
            if total <= limit:
                break
            if not self._remove(p, "disk"):
                continue
            total -= s.st_size
            self.stats.dropped += 1

    def disk_limit(self, held: int) -> int:
        """The disk tier's budget now: the configured cap, bounded by ``disk_free_fraction`` of the space it finds
        (free space on its filesystem plus the ``held`` bytes the tier already uses)."""
        try:
            free = shutil.disk_usage(self.disk_dir).free
        except OSError:
            return self.disk_bytes
        return min(self.disk_bytes, int((free + held) * self.disk_free_fraction))

    def _copy_atomic(self, src: Path, dst: Path) -> None:
        tmp = tmp_files.tmp_path(dst.parent, dst.name)
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.utime(tmp, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns))
            os.replace(tmp, dst)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def promote(self, key: str) -> bool:
        """Copy a disk entry into the memory tier, verifying every chunk first; True if it is now in memory.
        Storage errors are caught (counted, logged once): the request runs as a miss."""
        src, dst = self._path(self.disk_dir, key), self._path(self.mem_dir, key)
        try:
            with self._lock():
                if dst.exists():
                    return True
                if not src.exists():
                    return False
                try:
                    st = src.stat()
                    open_file(src, verify=True)
                except (CorruptEntry, ValueError) as e:
                    self._discard(src, (str(src), st.st_ino, st.st_size, st.st_mtime_ns), str(e), "disk")
                    return False
            if not self.evict(room=src.stat().st_size):
                return False
            with self._lock():
                self._copy_atomic(src, dst)
                self._touch(dst)
                self.health.ok("mem", "promote")
                self._remove(src, "disk")  # an unwritable disk tier keeps its copy: a stale duplicate, not a fault
        except OSError as e:
            self.health.failed("mem", "promote", e, key=key)
            return False
        self.stats.promotions += 1
        self.evict()
        return True

    def prefetch(self, key: str) -> str | None:
        """Start promoting ``key`` in a background thread if it is on disk; returns where it is now."""
        where = self.locate(key)
        if where == "disk":
            with self._mu:
                if key not in self._promoting:
                    t = threading.Thread(target=self._promote_quietly, args=(key,), name=f"promote-{key[:8]}",
                                         daemon=True)
                    self._promoting[key] = t
                    t.start()
        return where

    def _promote_quietly(self, key: str) -> None:
        """A background promotion: nothing escapes the thread (``promote`` catches storage errors itself)."""
        try:
            self.promote(key)
        except Exception as e:
            self.health.failed("mem", "promote", e, key=key)

    def wait_promotion(self, key: str, timeout: float = 60.0) -> None:
        with self._mu:
            t = self._promoting.get(key)
        if t is not None:
            t.join(timeout)
            with self._mu:
                self._promoting.pop(key, None)


def from_settings(cache) -> ActivationStore:
    """The store ``cache`` (``Settings.cache``, from MASKEDIT_CACHE_*) describes: the same in every model process,
    so they share it."""
    return ActivationStore(cache.mem_dir, cache.disk_dir, cache.mem_bytes, cache.disk_bytes, cache.disk_free_fraction)
