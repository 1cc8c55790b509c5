"""Background writes into the activation store, one at a time in order on one thread: a finished template run's
entry, and a hit's heal (the entry rewritten with the rows of tokens another request had edited recomputed as
template context). Writes never fail a request; their wall and CPU time are logged and their CPU counted in the
store's stats (it competes with the denoise loop for the host's cores)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import logs
from .rows import Recorder
from .live import LiveEntry
from .store import ActivationStore, CorruptEntry, Entry

log = logging.getLogger(__name__)


class EntryWriter:
    def __init__(self, store: ActivationStore):
        self.store = store
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cache-writer")

    def save(self, key: str, live: LiveEntry, valid: np.ndarray, dtype: torch.dtype, then) -> None:
        """Write a completed template run's entry; ``then()`` runs afterwards, written or not."""
        self._pool.submit(self._save, key, live, valid, dtype, then)

    def heal(self, key: str, entry: Entry, tokens: np.ndarray, patch: Recorder, then) -> None:
        """Rewrite ``entry`` with ``patch``'s rows at ``tokens`` and those tokens valid, unless the entry changed
        meanwhile (rewritten, evicted: its tokens may differ, the patch is dropped); ``then()`` runs afterwards."""
        self._pool.submit(self._heal, key, entry, tokens, patch, then)

    def _save(self, key, live: LiveEntry, valid, dtype, then) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            live.recorder.synchronize()  # its last device-to-host copies have landed
            self.store.put(key, {**live.recorder.tensors(), "valid": valid.astype(np.uint8)},
                           {**live.meta, "dtype": str(dtype).removeprefix("torch.")})
            self.store.stats.record_cpu_s += _wrote("recorded activations", key, t0, c0,
                                                    bytes=live.recorder.nbytes)
        except Exception:
            log.exception("could not save activations for %s", key)
        finally:
            then()

    def _heal(self, key, entry: Entry, tokens: np.ndarray, patch: Recorder, then) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if self.store.current(key) is not entry:
                return
            patch.synchronize()
            entry.verify()  # every chunk: a rewrite would otherwise carry bad bytes on under fresh checksums
            t = torch.from_numpy(tokens)
            arrays = {name: entry.tensor(name).clone() for name in entry.arrays}  # own copies
            if entry.meta.get("layout") == "per_block":  # a UNet's: each block's rows at its level's tokens
                for kind, rows in (("y", patch.y), ("k", patch.k), ("v", patch.v)):
                    for b, r in rows.items():
                        arrays[f"{kind}.{b}"][:, :, patch.index[b]] = r
            else:
                arrays["y"][:, :, t], arrays["k"][:, :, t], arrays["v"][:, :, t] = patch.y, patch.k, patch.v
            arrays["valid"][t] = 1
            if self.store.put(key, arrays, {**entry.meta, "valid_tokens": int(arrays["valid"].sum())}) is None:
                return
            self.store.stats.heals += 1
            self.store.stats.heal_cpu_s += _wrote("healed activations", key, t0, c0, tokens=int(tokens.size))
        except CorruptEntry as e:
            self.store.invalidate(entry, str(e))
        except Exception:
            log.exception("could not heal activations for %s", key)
        finally:
            then()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)


def _wrote(msg: str, key: str, t0: float, c0: float, **fields) -> float:
    """Log a write begun at ``t0`` (thread CPU ``c0``) with its wall and CPU time; returns the CPU seconds."""
    cpu = time.thread_time() - c0
    logs.event(log, msg, key=key, **fields, wall_ms=round(1000 * (time.perf_counter() - t0), 1),
               cpu_ms=round(1000 * cpu, 1))
    return cpu
