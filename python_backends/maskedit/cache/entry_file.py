"""One activation entry on disk and in memory: a safetensors file (one template's recorded rows plus JSON metadata),
mapped read-only without a copy.

Every read of an entry's bytes that reaches a computation goes through ``Entry.rows`` (or ``verify``), which checks
the chunks it reads against the checksums written with the entry (``integrity``).
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import integrity
from .integrity import CorruptEntry

# safetensors dtype -> (numpy dtype of the mapped view, torch dtype). numpy has no bfloat16: BF16 rows are mapped
# as their raw 16-bit words and reinterpreted by ``Entry.tensor`` (entries are written in the model's dtype).
_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.uint16, torch.bfloat16),
           "U8": (np.uint8, torch.uint8), "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32)}
# Arrays up to this size are verified whenever the entry is opened: a cache decision reads them (``valid``).
SMALL_BYTES = 1 << 20


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
    ident: tuple | None = None  # (path, inode, size, mtime_ns) of the file mapped

    def tensor(self, name: str) -> torch.Tensor:
        """``arrays[name]`` as a CPU tensor of its real dtype, sharing the mapping (no copy; never write to it).
        Unverified: computations read through ``rows``."""
        return as_tensor(self.arrays[name], self.dtypes.get(name))

    def rows(self, name: str, *index: int) -> torch.Tensor:
        """``tensor(name)[index]`` after verifying the chunks it covers (raises ``CorruptEntry`` naming this
        entry's key)."""
        self.verify(name, *index)
        return self.tensor(name)[index] if index else self.tensor(name)

    def verify(self, name: str | None = None, *index: int) -> None:
        """Verify ``name``'s chunks under ``index`` (every array when ``name`` is None)."""
        try:
            if name is None:
                integrity.verify_all(self.meta, self.arrays)
            else:
                integrity.verify(self.meta, self.arrays, name, index)
        except CorruptEntry as e:
            raise CorruptEntry(f"activation entry {self.key}: {e}", self) from None


def as_tensor(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor view of a (possibly read-only, mapped) array, reinterpreted as ``dtype`` (bf16 from raw words)."""
    with warnings.catch_warnings():  # read-only mappings: torch warns that writes are undefined; we never write
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    return t.view(dtype) if dtype is not None and t.dtype != dtype else t


class MappedArrays(dict):
    """name -> view on a mapped entry, with ``dtypes``: each one's real element type (bf16 views hold raw words)."""

    def __init__(self, arrays: dict[str, np.ndarray], dtypes: dict[str, torch.dtype], mapping: np.ndarray):
        super().__init__(arrays)
        self.dtypes = dtypes
        self.mapping = mapping  # the whole file, mapped: what a GPU loader page-locks once


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


def open_file(path: Path, verify: bool = True) -> tuple[dict, MappedArrays, int]:
    """Map a safetensors entry; check its structure, its checksum table and its small arrays always, and every
    chunk when ``verify`` (promotion, tests; the loader verifies each block's rows as it copies them)."""
    header, data_start = _read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    try:
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
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptEntry(f"bad header: {type(e).__name__}") from None
    integrity.check_table(info, arrays)
    for name, a in arrays.items():
        if verify or a.nbytes <= SMALL_BYTES:
            integrity.verify(info, arrays, name)
    return info, MappedArrays(arrays, dtypes, mm), size
