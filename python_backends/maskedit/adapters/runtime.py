"""The adapters of one denoiser: loaded on first use and kept in host (or device) memory by name and file digest,
least recently used dropped beyond a byte budget; a file replaced since a request was checked is refused for that
request (its digest differs)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from maskedit_common.loras import FIELD

from ..errors import InvalidInput
from . import convert, delta
from .library import AdapterLibrary, ResolvedRef

log = logging.getLogger(__name__)


class AdapterRuntime:
    def __init__(self, family, denoiser, library: AdapterLibrary, budget_bytes: int = 2 << 30):
        self.family, self.denoiser, self.library = family, denoiser, library
        self.budget = budget_bytes
        self._loaded: OrderedDict[tuple[str, str], convert.LoadedAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "load_s": 0.0}

    def get(self, ref: ResolvedRef) -> convert.LoadedAdapter:
        key = (ref.name, ref.digest)
        with self._lock:
            hit = self._loaded.get(key)
            if hit is not None:
                self._loaded.move_to_end(key)
                self.stats["hits"] += 1
                return hit
        f = self.library.file(ref.name)
        if ref.digest and f.digest != ref.digest:
            raise InvalidInput(f"adapter {ref.name!r} was replaced while the request was in flight (digest "
                               f"{ref.digest} checked, {f.digest} now); send it again", FIELD)
        t0 = time.perf_counter()
        adapter = convert.load(f, self.family, self.denoiser)
        delta.attach(self.denoiser, adapter)
        dt = time.perf_counter() - t0
        log.info("loaded adapter %s (%s, %d modules, ranks %s, %d bytes) in %.3fs", f.name, f.format,
                 len(adapter.modules), adapter.ranks, adapter.nbytes, dt)
        with self._lock:
            self.stats["misses"] += 1
            self.stats["load_s"] += dt
            self._loaded[key] = adapter
            while len(self._loaded) > 1 and sum(a.nbytes for a in self._loaded.values()) > self.budget:
                self._loaded.popitem(last=False)
        return adapter

    def resolve(self, refs) -> tuple[tuple[convert.LoadedAdapter, float], ...]:
        """``refs`` (``ResolvedRef`` or dicts with name, scale, digest) to loaded adapters with their weights."""
        out = []
        for r in refs:
            r = r if isinstance(r, ResolvedRef) else ResolvedRef(r["name"], float(r["scale"]), r.get("digest", ""))
            out.append((self.get(r), r.scale))
        return tuple(out)

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._loaded.values())
