"""Prefetch from pre-processing: as soon as a request's ``LORAS`` are checked, its adapters not yet in the host
cache are converted there on a background thread (the response is never delayed), so that when the request reaches
a denoise instance its load is a memory read, or nothing when that instance holds them already.

Conversion needs the denoiser's module tree only (names and widths), not its weights: a ``meta``-device skeleton
built from the model directory's config (``skeleton``). Factors are stored in the served dtype, as the denoise
process would convert them. A failure is logged and counted, never raised: the denoise process loads (and refuses)
the adapter itself."""

from __future__ import annotations

import logging
import threading
import time

from .. import logs
from ..device import torch_dtype
from . import skeleton
from .host_cache import AdapterHostCache, entry_key
from .library import AdapterLibrary, ResolvedRef
from .loader import AdapterLoader
from .runtime import from_library

log = logging.getLogger(__name__)


class AdapterPrefetcher:
    def __init__(self, settings, family, library: AdapterLibrary, host: AdapterHostCache, threads: int = 1):
        self.settings, self.family, self.library, self.host = settings, family, library, host
        self.stats = host.stats
        self.fingerprint = skeleton.fingerprint(settings, family)
        self._skeleton = None
        self._mu = threading.Lock()
        self._inflight: set[str] = set()
        self.loader = AdapterLoader(self._load, threads)

    def start(self, refs: tuple[ResolvedRef, ...]) -> list:
        """Start converting each adapter of ``refs`` the host tier lacks; returns the futures started (tests wait on
        them; the serving path does not)."""
        started = []
        for r in refs:
            key = entry_key(r.name, r.digest, self.fingerprint)
            with self._mu:
                if key in self._inflight:
                    continue
                if self.host.contains(key):
                    self.stats.count("host", "hit")
                    continue
                self.stats.count("host", "miss")
                self._inflight.add(key)
            started.append(self.loader.submit((r, key)))
        return started

    def _denoiser(self):
        with self._mu:
            if self._skeleton is None:
                self._skeleton = skeleton.denoiser_skeleton(self.settings, self.family)
            return self._skeleton

    def _load(self, job) -> bool:
        ref, key = job
        t0 = time.perf_counter()
        if not self.host.claim(key):  # a denoise instance (or another prefetch) converts it already
            with self._mu:
                self._inflight.discard(key)
            return False
        try:
            adapter = from_library(self.library, ref, self.family, self._denoiser(), device="cpu",
                                   dtype=torch_dtype(self.settings))
            stored = self.host.put(key, adapter)
        except Exception as e:  # noqa: BLE001 - the denoise process loads (and refuses) it itself
            self.stats.count("host", "failed")
            logs.event(log, "adapter prefetch failed", logging.WARNING, name=ref.name, digest=ref.digest,
                       error=f"{type(e).__name__}: {str(e)[:200]}")
            return False
        finally:
            self.host.release(key)
            with self._mu:
                self._inflight.discard(key)
        dt = time.perf_counter() - t0
        self.stats.loaded("library", dt)
        logs.event(log, "adapter prefetched", name=ref.name, digest=ref.digest, stored=stored,
                   modules=len(adapter.modules), bytes=adapter.nbytes, seconds=round(dt, 4))
        return stored


def from_settings(settings, library: AdapterLibrary, stats=None) -> AdapterPrefetcher | None:
    """The prefetcher of a pre-processing process, or None when there is no host tier to fill."""
    from ..components import family
    from .host_cache import from_settings as host_from_settings

    host = host_from_settings(settings, stats)
    return AdapterPrefetcher(settings, family(settings), library, host) if host is not None else None
