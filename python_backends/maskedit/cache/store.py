"""The activation store: a host-memory tier shared by processes, LRU-evicted to a disk tier.

Each entry is one safetensors file (one template's recorded activations plus JSON metadata). The memory
tier is a directory on a RAM filesystem (``/dev/shm`` by default), so every Triton model process can map
the same bytes without copying: preprocess checks and prefetches, masked_denoise reads and records.

Crash safety: a writer fills a hidden temporary file and ``os.replace``-s it into place, so an entry is
visible only when complete; a writer killed mid-way leaves only a temporary file, swept later. Each entry
carries the CRC32 of its tensor bytes in its metadata; a file whose size or checksum is wrong is a miss
and is deleted, never served. Two processes recording the same key each write a complete file and the
last rename wins. LRU order is the file's access time (set on every open); eviction moves the oldest memory
entries to disk under an inter-process lock; promotion copies a disk entry back (optionally in a thread
while the request still queues).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import struct
import threading
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
# safetensors dtype -> (numpy dtype of the mapped view, torch dtype). numpy has no bfloat16: BF16 rows are mapped
# as their raw 16-bit words and reinterpreted by ``Entry.tensor`` (entries are written in the model's dtype).
_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.uint16, torch.bfloat16),
           "U8": (np.uint8, torch.uint8), "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32)}
_STALE_TMP_S = 600.0
MAPPED_CAP = 64  # entries a process keeps mapped for reuse (requests in flight hold their own on top)
VERIFIED_CAP = 4096  # file identities whose checksum this process has checked (forgetting one costs a re-check)
# The disk tier never takes more than this share of the space its filesystem has (free plus what the tier holds):
# a fixed cap alone would fill a small disk.
DISK_FREE_FRACTION = 0.5


@dataclass
class Entry:
    """An opened entry: arrays are read-only views on the mapped file (no copy)."""

    key: str
    path: Path
    tier: str
    meta: dict
    arrays: dict[str, np.ndarray]
    nbytes: int
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # each array's element type (bf16: raw words)
    mapping: np.ndarray | None = None  # the whole mapped file, which every array views
    pinned: bool | None = None  # page-locked for GPU copies (set by a GPU loader on first use)

    def tensor(self, name: str) -> torch.Tensor:
        """``arrays[name]`` as a CPU tensor of its real dtype, sharing the mapping (no copy; never write to it)."""
        return as_tensor(self.arrays[name], self.dtypes.get(name))


def as_tensor(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor view of a (possibly read-only, mapped) array, reinterpreted as ``dtype`` (bf16 from raw words)."""
    with warnings.catch_warnings():  # read-only mappings: torch warns that writes are undefined; we never write
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    return t.view(dtype) if dtype is not None and t.dtype != dtype else t


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    corrupt: int = 0
    inserts: int = 0
    heals: int = 0  # entries rewritten with tokens another request had edited recomputed as template context
    dropped: int = 0  # evicted from the disk tier (gone)
    # CPU seconds of the background writes (a template run's entry, a heal's rewrite): work that competes with the
    # denoise loop for the host's cores, reported so capacity models can charge it.
    record_cpu_s: float = 0.0
    heal_cpu_s: float = 0.0
    extra: dict = field(default_factory=dict)


class CorruptEntry(Exception):
    pass


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptEntry("shorter than a header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise CorruptEntry("header length is implausible")
        header = f.read(n)
    if len(header) != n:
        raise CorruptEntry("truncated header")
    try:
        return json.loads(header), 8 + n
    except ValueError as e:
        raise CorruptEntry(f"bad header: {e}") from None


class MappedArrays(dict):
    """name -> view on a mapped entry, with ``dtypes``: each one's real element type (bf16 views hold raw words)."""

    def __init__(self, arrays: dict[str, np.ndarray], dtypes: dict[str, torch.dtype], mapping: np.ndarray):
        super().__init__(arrays)
        self.dtypes = dtypes
        self.mapping = mapping  # the whole file, mapped: what a GPU loader page-locks once


def _raw(a) -> np.ndarray:
    """The bytes of an array or CPU tensor of any dtype (bf16 included), as a flat uint8 array."""
    if isinstance(a, torch.Tensor):
        return a.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _crc(arrays: dict) -> int:
    crc = 0
    for name in sorted(arrays):
        crc = zlib.crc32(memoryview(_raw(arrays[name])), crc)
    return crc


def open_file(path: Path, verify: bool = True) -> tuple[dict, dict[str, np.ndarray], int]:
    """Map a safetensors file; check its size always and its checksum when ``verify``."""
    header, data_start = _read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    size = path.stat().st_size
    if size != data_start + end:
        raise CorruptEntry(f"size {size} != {data_start + end} expected from the header")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    arrays, dtypes = {}, {}
    for name, t in header.items():
        if t["dtype"] not in _DTYPES:
            raise CorruptEntry(f"unsupported dtype {t['dtype']}")
        view, dtypes[name] = _DTYPES[t["dtype"]]
        a, b = t["data_offsets"]
        arrays[name] = mm[data_start + a:data_start + b].view(view).reshape(t["shape"])
    info = json.loads(meta.get("maskedit", "{}"))
    if verify and info.get("crc32") is not None and _crc(arrays) != int(info["crc32"]):
        raise CorruptEntry("checksum mismatch")
    return info, MappedArrays(arrays, dtypes, mm), size


class ActivationStore:
    def __init__(self, mem_dir: str | Path, disk_dir: str | Path, mem_bytes: int, disk_bytes: int,
                 disk_free_fraction: float = DISK_FREE_FRACTION):
        self.mem_dir, self.disk_dir = Path(mem_dir), Path(disk_dir)
        self.mem_bytes, self.disk_bytes = int(mem_bytes), int(disk_bytes)
        self.disk_free_fraction = disk_free_fraction
        for d in (self.mem_dir, self.disk_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.stats = StoreStats()
        self._verified: dict[tuple, bool] = {}  # (path, inode, size, mtime_ns) checked here, oldest first
        self._mapped: dict[tuple, Entry] = {}  # entries this process has mapped, by the same identity
        self._promoting: dict[str, threading.Thread] = {}
        self._mu = threading.Lock()
        self._sweep_tmp()

    # -- paths and locking --------------------------------------------------------------------------
    def _path(self, tier_dir: Path, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad cache key {key!r}")
        return tier_dir / f"{key}{SUFFIX}"

    @contextlib.contextmanager
    def _lock(self):
        """Inter-process lock for eviction and promotion (flock on a file in the memory tier)."""
        with open(self.mem_dir / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _sweep_tmp(self) -> None:
        now = time.time()
        for d in (self.mem_dir, self.disk_dir):
            for p in d.glob(".tmp-*"):
                pid = p.name.split("-")[2] if p.name.count("-") >= 3 else ""
                alive = pid.isdigit() and Path(f"/proc/{pid}").exists()
                with contextlib.suppress(OSError):
                    if not alive or now - p.stat().st_mtime > _STALE_TMP_S:
                        p.unlink()

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
                "record_cpu_s": s.record_cpu_s, "heal_cpu_s": s.heal_cpu_s, "mem_bytes": b["mem"],
                "disk_bytes": b["disk"], "mem_entries": len(self.entries("mem")),
                "disk_entries": len(self.entries("disk"))}

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
        if ident in self._mapped:  # the same bytes as last time (any rewrite changes inode or mtime): reuse
            return self._mapped[ident]
        try:
            info, arrays, size = open_file(path, verify=ident not in self._verified)
        except (CorruptEntry, ValueError, OSError) as e:
            self._discard(path, f"{e}")
            return None
        self._verified[ident] = True
        while len(self._verified) > VERIFIED_CAP:  # every write and promotion makes a new identity: keep it bounded
            self._verified.pop(next(iter(self._verified)))
        entry = Entry(key=key, path=path, tier=tier, meta=info, arrays=arrays, nbytes=size, dtypes=arrays.dtypes,
                      mapping=arrays.mapping)
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

    def _discard(self, path: Path, why: str) -> None:
        log.warning("discarding corrupt activation entry %s: %s", path.name, why)
        self.stats.corrupt += 1
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # -- writes -------------------------------------------------------------------------------------
    def put(self, key: str, arrays: dict, meta: dict) -> Path:
        """Write an entry atomically into the memory tier, then evict to stay within budget. ``arrays`` are numpy
        arrays or CPU tensors; tensors keep their dtype (bf16/fp16 entries of a bf16/fp16 model)."""
        arrays = {k: (v.detach().contiguous() if isinstance(v, torch.Tensor) else
                      torch.from_numpy(np.ascontiguousarray(v))) for k, v in arrays.items()}
        info = dict(meta, crc32=_crc(arrays), key=key, created=time.time())
        path = self._path(self.mem_dir, key)
        tmp = self.mem_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{key}"
        try:
            save_file(arrays, str(tmp), metadata={"maskedit": json.dumps(info)})
            os.replace(tmp, path)  # the entry becomes visible complete, or not at all
            # LRU order must come from one clock: the filesystem stamps a new file with a coarse (jiffy) time,
            # which can sort before a touch made a moment earlier with the fine one.
            self._touch(path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self.stats.inserts += 1
        self.evict()
        return path

    def delete(self, key: str) -> None:
        for d in (self.mem_dir, self.disk_dir):
            with contextlib.suppress(FileNotFoundError):
                self._path(d, key).unlink()

    def evict(self) -> None:
        """Move least recently used memory entries to disk until the memory tier fits; trim the disk tier."""
        with self._lock():
            mem = sorted(self.entries("mem"), key=lambda e: e[1].st_atime_ns)
            total = sum(s.st_size for _, s in mem)
            for p, s in mem:
                if total <= self.mem_bytes:
                    break
                self._copy_atomic(p, self.disk_dir / p.name)
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                total -= s.st_size
                self.stats.evictions += 1
            disk = sorted(self.entries("disk"), key=lambda e: e[1].st_atime_ns)
            total = sum(s.st_size for _, s in disk)
            limit = self.disk_limit(total)
            for p, s in disk:
                if total <= limit:
                    break
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
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
        tmp = dst.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{dst.name}"
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.utime(tmp, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns))
            os.replace(tmp, dst)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def promote(self, key: str) -> bool:
        """Copy a disk entry into the memory tier (verifying it on the way); True if it is now in memory."""
        src, dst = self._path(self.disk_dir, key), self._path(self.mem_dir, key)
        with self._lock():
            if dst.exists():
                return True
            if not src.exists():
                return False
            try:
                open_file(src, verify=True)
            except (CorruptEntry, ValueError, OSError) as e:
                self._discard(src, str(e))
                return False
            self._copy_atomic(src, dst)
            self._touch(dst)
            with contextlib.suppress(FileNotFoundError):
                src.unlink()
        self.stats.promotions += 1
        self.evict()
        return True

    def prefetch(self, key: str) -> str | None:
        """Start promoting ``key`` in a background thread if it is on disk; returns where it is now."""
        where = self.locate(key)
        if where == "disk":
            with self._mu:
                if key not in self._promoting:
                    t = threading.Thread(target=self.promote, args=(key,), name=f"promote-{key[:8]}", daemon=True)
                    self._promoting[key] = t
                    t.start()
        return where

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
