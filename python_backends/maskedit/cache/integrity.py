"""Checksums over an entry's chunks, so that no byte of an entry reaches a computation unverified.

An entry's arrays are cut into chunks along their leading dimensions (``chunk_dims``): a Flux entry's rows per
(step, block), a UNet's per (step, guidance row), small arrays whole. Each chunk's xxh3-64 digest is written into
the entry's metadata. A chunk is verified where its bytes are read, every time: the loader verifies the rows it
copies for a block (on its own thread, ahead of the block, so the loop does not wait), a heal verifies every chunk
before it rewrites the entry (it would otherwise launder bad bytes under fresh checksums), promotion before it
copies a disk entry up, and every open verifies the small arrays a cache decision reads. A file's identity (inode,
size, times) says nothing about its bytes: silent disk or memory corruption keeps all three, so nothing is checked
once and then trusted. xxh3 (the ``xxhash`` package, 3.0 on) releases the GIL while it hashes. On the CPU it costs less
than the copy it guards; a GPU copies page-locked rows several times faster than one thread hashes them (an H200:
55 GB/s against ~6), so the GPU loader verifies on several threads (``loader``).
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

ALGO = "xxh3_64"


class CorruptEntry(Exception):
    """An entry's bytes or structure are not what was written: the entry is discarded, never served. ``entry``:
    the opened entry it was found in, when there is one (so its reader can discard that very file)."""

    def __init__(self, message: str, entry=None):
        super().__init__(message)
        self.entry = entry


def corrupt_entry(e: BaseException | None) -> CorruptEntry | None:
    """The ``CorruptEntry`` behind ``e`` (raised inside a model's forward, it may arrive wrapped), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CorruptEntry):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def chunk_dims(ndim: int) -> int:
    """How many leading dimensions index an array's chunks: (steps, blocks, N, D) -> 2, (N, D) -> 0."""
    return min(2, max(0, ndim - 2))


def _flat(a) -> np.ndarray:
    """The bytes of a C-contiguous numpy array or CPU tensor (any dtype, bf16 included), flat, without a copy."""
    if isinstance(a, torch.Tensor):
        return a.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _digest(b: np.ndarray) -> str:
    return f"{xxhash.xxh3_64_intdigest(memoryview(b)):016x}"


def table(arrays: dict) -> dict:
    """``{name: {"dims": d, "sums": [hex digest per chunk, in C order]}}`` for an entry's metadata."""
    out = {}
    for name, a in arrays.items():
        shape = tuple(a.shape)
        d = chunk_dims(len(shape))
        n = int(np.prod(shape[:d], dtype=np.int64)) if d else 1
        flat = _flat(a)
        size = flat.size // n if n else 0
        out[name] = {"dims": d, "sums": [_digest(flat[i * size:(i + 1) * size]) for i in range(n)]}
    return out


def check_table(info: dict, arrays: dict) -> None:
    """The metadata holds a well-formed checksum table for exactly these arrays (an entry without one is from an
    older format, or its header was damaged: it cannot be verified, so it is not used)."""
    sums = info.get("chunks")
    if not isinstance(sums, dict) or set(sums) != set(arrays) or info.get("hash") != ALGO:
        raise CorruptEntry("no checksum table for its arrays")
    for name, a in arrays.items():
        t = sums[name]
        if not isinstance(t, dict) or t.get("dims") != chunk_dims(a.ndim) or \
                len(t.get("sums", ())) != int(np.prod(a.shape[:t["dims"]], dtype=np.int64)):
            raise CorruptEntry(f"checksum table does not match array {name!r}")


def verify(info: dict, arrays: dict, name: str, index: tuple = ()) -> None:
    """Verify the chunks of ``arrays[name]`` that ``arrays[name][index]`` reads (``index``: leading integer
    indices; fewer than the chunk dimensions covers every chunk below them). Raises ``CorruptEntry``."""
    a = arrays[name]
    t = info["chunks"][name]
    d = t["dims"]
    lead = a.shape[:d]
    n = int(np.prod(lead, dtype=np.int64)) if d else 1
    size = a.nbytes // n if n else 0
    if len(index) >= d:
        first = int(np.ravel_multi_index(tuple(int(i) for i in index[:d]), lead)) if d else 0
        last = first + 1
    else:  # a prefix: the block of chunks under it
        under = int(np.prod(lead[len(index):], dtype=np.int64))
        first = (int(np.ravel_multi_index(tuple(int(i) for i in index), lead[:len(index)])) if index else 0) * under
        last = first + under
    flat = a.reshape(-1).view(np.uint8)
    for k in range(first, last):
        if _digest(flat[k * size:(k + 1) * size]) != t["sums"][k]:
            raise CorruptEntry(f"checksum mismatch in {name} chunk {k}")


def verify_all(info: dict, arrays: dict) -> None:
    for name in arrays:
        verify(info, arrays, name)
