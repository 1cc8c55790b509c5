"""Template runs in progress in this engine, readable by the requests that follow them.

A request on a template whose template run is still running here does not recompute the whole model: it reads the
rows the run has recorded so far from memory (a ``LiveEntry``, shaped like a stored entry). Joining at a later step
boundary it is always at least one step behind; a step the run has not recorded yet is computed in full.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .rows import Recorder


@dataclass
class LiveEntry:
    """A template run's entry while it records: what followers read, and what the store saves once complete."""

    meta: dict
    arrays: dict  # y / k / v: the recorder's host tensors; valid: numpy bool per token
    recorder: Recorder
    pinned: bool = True  # the recorder's buffers are page-locked on a GPU

    def tensor(self, name: str) -> torch.Tensor:
        return self.arrays[name]

    def rows(self, name: str, *index: int) -> torch.Tensor:
        """As ``Entry.rows``; nothing to verify: the rows are this process's own memory, written by the run."""
        return self.arrays[name][index] if index else self.arrays[name]

    def step_event(self, step: int):
        """Step ``step``'s rows have landed in host memory (GPU: an event on the recording stream)."""
        return self.recorder.step_event(step)


class LiveRuns:
    """key -> its template run in progress (one per key), until its entry is saved or the run fails."""

    def __init__(self):
        self._runs: dict[str, LiveEntry] = {}
        self._mu = threading.Lock()

    def get(self, key: str) -> LiveEntry | None:
        with self._mu:
            return self._runs.get(key)

    def start(self, key: str, live: LiveEntry) -> bool:
        """Register a run; False if one of ``key`` is already in progress."""
        with self._mu:
            if key in self._runs:
                return False
            self._runs[key] = live
            return True

    def end(self, key: str) -> None:
        with self._mu:
            self._runs.pop(key, None)

    def __contains__(self, key) -> bool:
        with self._mu:
            return key in self._runs
