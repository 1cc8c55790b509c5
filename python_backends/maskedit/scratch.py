"""The host-memory directories of one local serving run (``make demo``, ``make serve``, the test suite): the
activation store's memory tier, cancel markers, the admission board and the adapter host cache, in one fresh
directory (under /dev/shm where there is one) that the run's servers and router share through the environment, and
that is removed when the run stops, so a clean stop leaves nothing behind. A directory the caller set
(``MASKEDIT_*``) is kept as set, and kept."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

# each setting's folder inside the run's directory
SCRATCH_VARS = {"MASKEDIT_CACHE_MEM_DIR": "activations", "MASKEDIT_CACHE_DISK_DIR": "disk",
                "MASKEDIT_CANCEL_DIR": "cancel", "MASKEDIT_ADMISSION_DIR": "admission",
                "MASKEDIT_LORA_HOST_DIR": "adapters"}
# `make serve` keeps the disk tier where the settings put it (~/.cache/maskedit): a cache meant to outlive the run
# (the demo and the tests put it in their directory too)
RUN_VARS = {k: v for k, v in SCRATCH_VARS.items() if k != "MASKEDIT_CACHE_DISK_DIR"}


def make_scratch(prefix: str, variables: dict = RUN_VARS, override: bool = False) -> Path:
    """A fresh directory (in RAM where /dev/shm exists) with ``variables`` pointed into it in ``os.environ``,
    except those already set (``override``: those too)."""
    ram = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=ram))
    for var, name in variables.items():
        if override or var not in os.environ:
            os.environ[var] = str(d / name)
    return d


@contextlib.contextmanager
def run_scratch(variables: dict = RUN_VARS):
    """``make_scratch`` for the length of a ``with``: the variables it set are unset and the directory removed."""
    before = {v: os.environ.get(v) for v in variables}
    d = make_scratch(f"maskedit-{os.getuid()}-run-", variables)
    try:
        yield d
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
        shutil.rmtree(d, ignore_errors=True)
