"""The host tier of the adapter cache: converted adapters (each module's ``A``, ``B``, alpha, rank) as safetensors
files in one directory on a RAM filesystem, shared by every Triton model process of the host. Pre-processing fills
it ahead of a request (``prefetch``); a denoise instance that misses its own device tier reads the converted copy
here instead of reading and converting the library file again.

The activation store's patterns and pieces (``maskedit.cache``): one file per entry in the store's format (the
metadata carries an xxh3 checksum per array, ``integrity.table``), opened through ``entry_file.open_file`` and
verified whole on every read; a corrupt entry is deleted and counted, and its adapter comes from the library file
again. Writes go to a hidden temporary file renamed into place (an entry is visible complete or not at all); LRU
order is the file's access time, set on every read; eviction runs under an inter-process ``flock`` and keeps the
directory within its byte budget, on every write and when the tier is opened (a smaller budget applies at once). One
conversion per host: a process converting an adapter holds a marker file (``claim``); the others wait for its entry
(``wait``, on loader threads) instead of converting it too. Keys are the adapter's name, its file's digest and the
denoiser's fingerprint (``skeleton.fingerprint``). Storage errors (a full ``/dev/shm``) are logged and counted, never
raised: this tier is an optimisation, the library file stays the source."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from .. import logs
from ..cache import integrity, tmp_files
from ..cache.entry_file import as_tensor, open_file
from ..cache.file_lock import locked
from ..cache.integrity import CorruptEntry
from .convert import LoadedAdapter, LoraModule
from .stats import AdapterStats

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"


def _copy(arrays, name: str, device, dtype) -> torch.Tensor:
    """One mapped array as a tensor of its own memory on ``device``: copied by numpy (one memcpy; torch's threaded
    copy of a small tensor costs far more when the host's cores are busy), then moved or cast if needed."""
    t = as_tensor(np.array(arrays[name], copy=True), arrays.dtypes[name])
    return t.to(device, dtype or t.dtype).contiguous()


def entry_key(name: str, digest: str, fingerprint: str) -> str:
    """One converted adapter: names hold letters, digits, ``.``, ``_`` and ``-`` (never ``/``), the digest and the
    fingerprint are hex of fixed length, so the key is unique."""
    return f"{name}--{digest}--{fingerprint}"


class AdapterHostCache:
    def __init__(self, directory: str | Path, budget_bytes: int, stats: AdapterStats | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = int(budget_bytes)
        self.stats = stats or AdapterStats()
        self._sweep_tmp()
        # Opened with a smaller budget than the directory holds (a restart with a lower MASKEDIT_LORA_HOST_BYTES):
        # shrink now, not at the next write, which may never come for a host whose adapters are all cached.
        try:
            self.evict()
        except OSError as e:  # storage errors are logged, never raised (see the module's doc)
            self.stats.count("host", "error")
            logs.event(log, "adapter host cache eviction failed", logging.WARNING, error=str(e)[:200])

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad adapter cache key {key!r}")
        return self.dir / f"{key}{SUFFIX}"

    def _lock(self):
        return locked(self.dir / ".lock")

    def _sweep_tmp(self) -> None:
        """Temporary files of writers that died mid-way (their pid is gone) or long ago, and their markers."""
        now = time.time()
        for p in self.dir.glob(".loading-*"):  # conversion markers of processes gone
            if not self._live(p):
                with contextlib.suppress(OSError):
                    p.unlink()
        tmp_files.sweep(self.dir, now)  # a live writer's copy stays

    def entries(self) -> list[tuple[Path, os.stat_result]]:
        out = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                out.append((p, p.stat()))
        return out

    def resident_bytes(self) -> int:
        return sum(s.st_size for _, s in self.entries())

    def contains(self, key: str) -> bool:
        return self._path(key).exists()

    # -- reads --------------------------------------------------------------------------------------
    def get(self, key: str, device="cpu", dtype: torch.dtype | None = None) -> LoadedAdapter | None:
        """The adapter stored under ``key``, every byte verified, copied onto ``device`` (no mapping is kept: an
        evicted file's pages are freed at once); None on a miss or a corrupt entry (deleted, counted)."""
        path = self._path(key)
        try:
            st = path.stat()
            info, arrays, _ = open_file(path, verify=True)
            meta = info["adapter"]
            modules = {}
            for name, (alpha, r, rslora) in meta["modules"].items():
                A, B = (_copy(arrays, f"{name}.lora_{x}", device, dtype) for x in "AB")
                modules[name] = LoraModule(A, B, float(alpha), int(r), bool(rslora))
            adapter = LoadedAdapter(meta["name"], meta["digest"], meta["format"], modules)
        except FileNotFoundError:
            self.stats.count("host", "miss")
            return None
        except (CorruptEntry, KeyError, TypeError, ValueError, OSError) as e:
            self._discard(path, st, e)
            self.stats.count("host", "miss")
            return None
        self._touch(path)
        self.stats.count("host", "hit")
        return adapter

    def _discard(self, path: Path, st: os.stat_result, e: BaseException) -> None:
        self.stats.count("host", "corrupt")
        logs.event(log, "corrupt adapter cache entry discarded", logging.WARNING, entry=path.stem,
                   reason=f"{type(e).__name__}: {str(e)[:200]}")
        with contextlib.suppress(OSError):
            now = path.stat()
            if (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns):
                path.unlink()  # that very file: one rewritten since is not touched

    @staticmethod
    def _touch(path: Path) -> None:
        """LRU order is the access time, set explicitly (relatime would not move it)."""
        with contextlib.suppress(OSError):
            st = path.stat()
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))

    # -- one conversion per host ----------------------------------------------------------------------
    def _marker(self, key: str) -> Path:
        return self.dir / f".loading-{key}"

    def claim(self, key: str) -> bool:
        """Mark ``key`` as being converted by this process (False if a live process holds the mark), so that the
        host's other processes wait for its entry instead of converting the same file too."""
        m = self._marker(key)
        for _ in range(2):
            try:
                fd = os.open(m, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                if self._live(m):
                    return False
                with contextlib.suppress(OSError):
                    m.unlink()  # its holder died or hung: taken over
                continue
            except OSError:
                return True  # no mark possible (a full tier): convert without one
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return True
        return False

    def release(self, key: str) -> None:
        with contextlib.suppress(OSError):
            self._marker(key).unlink()

    @staticmethod
    def _live(marker: Path) -> bool:
        try:
            pid = marker.read_text().strip()
            age = time.time() - marker.stat().st_mtime
        except OSError:
            return False
        if not pid:  # created a moment ago, its pid not written yet
            return age < 5.0
        return tmp_files.writer_alive(pid) and age < tmp_files.STALE_S

    def wait(self, key: str, timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds; on a loader thread, never the loop) while another live process converts
        ``key``; True if its entry is there now."""
        m, deadline = self._marker(key), time.monotonic() + timeout
        while not self.contains(key) and m.exists() and self._live(m) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.contains(key)

    # -- writes -------------------------------------------------------------------------------------
    def put(self, key: str, adapter: LoadedAdapter) -> bool:
        """Store ``adapter`` under ``key`` (atomically, room made first); False if it was not stored (larger than
        the budget, or a storage error: logged and counted)."""
        arrays, modules = {}, {}
        for name, m in adapter.modules.items():
            arrays[f"{name}.lora_A"] = m.A.detach().to("cpu").contiguous()
            arrays[f"{name}.lora_B"] = m.B.detach().to("cpu").contiguous()
            modules[name] = [m.alpha, m.r, m.rslora]
        info = {"adapter": {"name": adapter.name, "digest": adapter.digest, "format": adapter.format,
                            "modules": modules},
                "hash": integrity.ALGO, "chunks": integrity.table(arrays), "key": key, "created": time.time()}
        need = sum(a.numel() * a.element_size() for a in arrays.values()) + 2 * len(json.dumps(info)) + \
            256 * len(arrays)
        if need > self.budget:
            logs.event(log, "adapter larger than the host cache budget; not cached", logging.WARNING, key=key,
                       bytes=need, budget=self.budget)
            return False
        path = self._path(key)
        tmp = tmp_files.tmp_path(self.dir, key)
        try:
            self.evict(room=need)
            save_file(arrays, str(tmp), metadata={"maskedit": json.dumps(info)})
            os.replace(tmp, path)
            self._touch(path)  # one clock for LRU order (a new file's own stamp is coarser)
        except Exception as e:  # noqa: BLE001 - a full or unwritable tier: the adapter is served from its copy
            self.stats.count("host", "error")
            logs.event(log, "adapter host cache write failed", logging.WARNING, key=key,
                       error=f"{type(e).__name__}: {str(e)[:200]}")
            return False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self.evict()
        logs.event(log, "adapter cached in host memory", key=key, bytes=path.stat().st_size if path.exists() else 0)
        return True

    def evict(self, room: int = 0) -> None:
        """Delete least recently used entries until the directory holds ``room`` more bytes within its budget."""
        with self._lock():
            entries = sorted(self.entries(), key=lambda e: e[1].st_atime_ns)
            total = sum(s.st_size for _, s in entries)
            for p, s in entries:
                if total + room <= self.budget:
                    break
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self.stats.count("host", "error")
                    logs.event(log, "adapter host cache delete failed", logging.WARNING, entry=p.stem,
                               error=str(e)[:200])
                    continue
                total -= s.st_size
                self.stats.count("host", "eviction")
                logs.event(log, "adapter evicted", tier="host", entry=p.stem, bytes=s.st_size)


def from_settings(settings, stats: AdapterStats | None = None) -> AdapterHostCache | None:
    """The host cache ``settings`` describe (the same directory in every model process), or None when it is off
    (``MASKEDIT_LORA_HOST_BYTES=0``) or its directory is unusable (served from the library file then)."""
    if settings.lora_host_bytes <= 0:
        return None
    try:
        return AdapterHostCache(settings.lora_host_cache_dir, settings.lora_host_bytes, stats)
    except OSError as e:
        logs.event(log, "adapter host cache unavailable; adapters load from the library", logging.WARNING,
                   dir=str(settings.lora_host_cache_dir), error=str(e)[:200])
        return None
