"""The adapters of one denoiser: the device tier of the adapter cache, and where a load looks next.

Three tiers: this process's device tier (converted factors on the denoiser's device, by name and file digest, least
recently used dropped beyond ``budget_bytes``) -> the host tier shared by the host's processes
(``host_cache.AdapterHostCache``: a memory read, no conversion) -> the library file (read and converted by
Diffusers' loaders, then written to the host tier for the next process). Concurrent loads of one adapter are done
once. An adapter is served under the digest its request was checked against: a tier holding that digest serves it;
a file replaced since is refused when it has to be read again (its digest differs). Hooks go on the denoiser
(``delta.attach``) where the caller says (the loop thread, at admission), never from a loader thread."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from maskedit_common.loras import FIELD

from .. import logs
from ..errors import InvalidInput
from . import convert
from .host_cache import AdapterHostCache, entry_key
from .library import AdapterLibrary, ResolvedRef
from .stats import AdapterStats

log = logging.getLogger(__name__)


def as_ref(r) -> ResolvedRef:
    return r if isinstance(r, ResolvedRef) else ResolvedRef(r["name"], float(r["scale"]), r.get("digest", ""))


def from_library(library: AdapterLibrary, ref: ResolvedRef, family, denoiser, device=None, dtype=None
                 ) -> convert.LoadedAdapter:
    """Read and convert ``ref``'s file, refusing a file whose digest is not the one the request was checked
    against."""
    f = library.file(ref.name)
    if ref.digest and f.digest != ref.digest:
        raise InvalidInput(f"adapter {ref.name!r} was replaced while the request was in flight (digest "
                           f"{ref.digest} checked, {f.digest} now); send it again", FIELD)
    return convert.load(f, family, denoiser, device=device, dtype=dtype)


class AdapterRuntime:
    def __init__(self, family, denoiser, library: AdapterLibrary, budget_bytes: int = 1 << 30,
                 host: AdapterHostCache | None = None, fingerprint: str = "", stats: AdapterStats | None = None):
        self.family, self.denoiser, self.library = family, denoiser, library
        self.budget = budget_bytes
        self.host, self.fingerprint = host, fingerprint
        self.stats = stats or (host.stats if host is not None else AdapterStats())
        self._loaded: OrderedDict[tuple[str, str], convert.LoadedAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str], threading.Lock] = {}
        self.host_wait_s = 30.0  # the longest wait for another process's conversion of the same adapter

    def cached(self, ref: ResolvedRef, count: bool = True) -> convert.LoadedAdapter | None:
        """The device tier's copy, or None."""
        key = (ref.name, ref.digest)
        with self._lock:
            hit = self._loaded.get(key)
            if hit is not None:
                self._loaded.move_to_end(key)
        if count:
            self.stats.count("device", "hit" if hit is not None else "miss")
        return hit

    def get(self, ref: ResolvedRef) -> convert.LoadedAdapter:
        hit = self.cached(ref)
        if hit is not None:
            return hit
        key = (ref.name, ref.digest)
        with self._lock:
            gate = self._inflight.setdefault(key, threading.Lock())
        with gate:  # a second request for the same adapter waits for the first load and finds it loaded
            hit = self.cached(ref, count=False)
            if hit is not None:
                return hit
            try:
                adapter = self._load(ref)
                self._keep(key, adapter)  # before the gate goes: a later caller finds it kept
            except Exception:
                self.stats.count("device", "failed")
                raise
            finally:
                with self._lock:
                    self._inflight.pop(key, None)
        return adapter

    def _load(self, ref: ResolvedRef) -> convert.LoadedAdapter:
        p = next(self.denoiser.parameters())
        t0 = time.perf_counter()
        hkey = entry_key(ref.name, ref.digest, self.fingerprint) if self.host is not None and ref.digest else None
        adapter = self.host.get(hkey, p.device, p.dtype) if hkey else None
        source = "host"
        claimed = False
        if adapter is None and hkey:
            claimed = self.host.claim(hkey)
            # another process (pre-processing's prefetch, another instance) converting it: its entry, not a second
            # conversion
            if not claimed and self.host.wait(hkey, self.host_wait_s):
                adapter = self.host.get(hkey, p.device, p.dtype)
        if adapter is None:
            source = "library"
            try:
                adapter = from_library(self.library, ref, self.family, self.denoiser)
                if hkey:
                    self.host.put(hkey, adapter)  # for the next process (and this one after a device eviction)
            finally:
                if claimed:
                    self.host.release(hkey)
        dt = time.perf_counter() - t0
        self.stats.loaded(source, dt)
        logs.event(log, "adapter loaded", name=ref.name, digest=ref.digest, source=source, format=adapter.format,
                   modules=len(adapter.modules), ranks=adapter.ranks, bytes=adapter.nbytes, seconds=round(dt, 4))
        return adapter

    def _keep(self, key, adapter: convert.LoadedAdapter) -> None:
        """Into the device tier; least recently used dropped beyond the budget (one in use by a running request
        stays alive through that request's reference until it ends)."""
        with self._lock:
            self._loaded[key] = adapter
            evicted = []
            while len(self._loaded) > 1 and sum(a.nbytes for a in self._loaded.values()) > self.budget:
                evicted.append(self._loaded.popitem(last=False))
        for (name, digest), a in evicted:
            self.stats.count("device", "eviction")
            logs.event(log, "adapter evicted", tier="device", name=name, digest=digest, bytes=a.nbytes)

    def resolve(self, refs) -> tuple[tuple[convert.LoadedAdapter, float], ...]:
        """``refs`` (``ResolvedRef`` or dicts with name, scale, digest) to loaded adapters with their weights."""
        out = []
        for r in refs:
            r = as_ref(r)
            out.append((self.get(r), r.scale))
        return tuple(out)

    def clear(self) -> None:
        """Empty the device tier (requests running keep the adapters they hold)."""
        with self._lock:
            self._loaded.clear()

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._loaded.values())
