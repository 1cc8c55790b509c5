"""The store under storage faults and silent corruption: budgets hold, nothing bad is served, errors are caught."""

import errno
import logging
import os
import threading

import numpy as np
import pytest

from maskedit.cache import entry_file, integrity
from maskedit.cache import store as store_mod
from maskedit.cache.store import ActivationStore, CorruptEntry, open_file


def rows(seed=0, steps=4, blocks=3, n=1000):
    rng = np.random.default_rng(seed)
    return {"y": rng.standard_normal((steps, blocks, n, 8), dtype=np.float32), "valid": np.ones(n, np.uint8)}


def size_of(tmp_path, a) -> int:
    return os.path.getsize(ActivationStore(tmp_path / "probe-m", tmp_path / "probe-d", 1 << 30, 1 << 30).put("x", a, {}))


def test_chunks_cover_what_an_index_reads():
    a = {"y": np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5), "v": np.ones(7, np.uint8)}
    info = {"chunks": integrity.table(a), "hash": integrity.ALGO}
    assert [t["dims"] for t in info["chunks"].values()] == [2, 0] and len(info["chunks"]["y"]["sums"]) == 6
    a["y"][1, 2, 0, 0] = -1  # chunk (1, 2)
    integrity.verify(info, a, "y", (0, 2))
    integrity.verify(info, a, "y", (1, 1))
    for index in ((1, 2), (1,), ()):  # the chunk itself, and every prefix that covers it
        with pytest.raises(CorruptEntry, match="y chunk 5"):
            integrity.verify(info, a, "y", index)


def test_bytes_changed_in_place_with_times_put_back_are_never_served(tmp_path, monkeypatch):
    """The fault run's case: random bytes written into the middle of an entry, its times restored. The store's
    mapping (same inode, size and times) is reused, and still the rows are checked where they are read."""
    monkeypatch.setattr(entry_file, "SMALL_BYTES", 4096)
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    path = s.put("k", rows(), {})
    e = s.open("k")
    assert e.rows("y", 2, 1).shape == (1000, 8)
    st = path.stat()
    off = int(e.arrays["y"][2, 1].ctypes.data - e.mapping.ctypes.data) + 100
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(os.urandom(64))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = s.open("k")
    assert again is e  # nothing about the file tells it changed
    e.rows("y", 2, 0)  # other chunks still verify
    with pytest.raises(CorruptEntry, match="activation entry k: checksum mismatch in y chunk 7") as err:
        e.rows("y", 2, 1)
    assert err.value.entry is e
    s.invalidate(e, str(err.value))
    assert s.stats.corrupt == 1 and s.locate("k") is None and s.open("k") is None


def test_corrupt_small_arrays_are_caught_at_every_open(tmp_path):
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    path = s.put("k", rows(), {})
    e = s.open("k")
    st = path.stat()
    off = int(e.arrays["valid"].ctypes.data - e.mapping.ctypes.data)
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(b"\x00")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert s.open("k") is None and s.stats.corrupt == 1 and not path.exists()


def test_an_entry_without_checksums_is_a_miss(tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "mem").mkdir()
    old = tmp_path / "mem" / "old.safetensors"
    save_file(rows(), str(old), metadata={"maskedit": '{"crc32": 1}'})  # written before chunk checksums
    with pytest.raises(CorruptEntry, match="no checksum table"):
        open_file(old)
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    assert s.open("old") is None and s.stats.corrupt == 1 and not old.exists()


def test_a_corrupt_disk_entry_is_not_promoted(tmp_path):
    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", int(one * 1.5), 1 << 30)
    s.put("a", rows(1), {})
    s.put("b", rows(2), {})  # "a" moves to disk
    disk = tmp_path / "disk" / "a.safetensors"
    raw = bytearray(disk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    disk.write_bytes(bytes(raw))
    assert s.open("a") is None and s.stats.corrupt == 1 and not disk.exists() and s.locate("a") is None


def test_unwritable_disk_tier_keeps_the_memory_tier_within_budget(tmp_path, monkeypatch, caplog):
    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", int(one * 3.5), 1 << 30)
    broken = threading.Event()
    real = s._copy_atomic

    def copy(src, dst):
        if broken.is_set() and dst.parent == s.disk_dir:
            raise PermissionError(errno.EACCES, "Permission denied", str(dst))
        return real(src, dst)

    monkeypatch.setattr(s, "_copy_atomic", copy)
    broken.set()
    with caplog.at_level(logging.WARNING, logger="maskedit"):
        for i in range(12):
            assert s.put(f"k{i}", rows(i), {}) is not None  # new entries still come in: the oldest are dropped
            assert s.tier_bytes()["mem"] <= s.mem_bytes
    assert s.health.degraded["disk"] and s.stats.errors >= 9 and s.stats.dropped >= 9
    assert sum("tier degraded" in r.getMessage() for r in caplog.records) == 1  # logged once, counted always
    broken.clear()
    s.put("after", rows(99), {})
    assert s.health.degraded["disk"] is None and s.locate("k9") == "disk"  # evicted to disk again


def test_memory_tier_that_cannot_delete_refuses_new_entries(tmp_path, monkeypatch):
    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", int(one * 2.5), 1 << 30)
    s.put("a", rows(1), {})
    s.put("b", rows(2), {})
    real_unlink = type(s.mem_dir).unlink

    def unlink(p, missing_ok=False):
        if p.parent == s.mem_dir and p.suffix == ".safetensors":
            raise PermissionError(errno.EPERM, "Operation not permitted", str(p))
        return real_unlink(p, missing_ok=missing_ok)

    monkeypatch.setattr(type(s.mem_dir), "unlink", unlink)
    assert s.put("c", rows(3), {}) is None
    assert s.tier_bytes()["mem"] <= s.mem_bytes and s.stats.refused == 1 and s.health.degraded["mem"]


@pytest.mark.parametrize("raised", ["oserror", "safetensors"])
def test_enospc_shrinks_the_budget_and_the_cache_keeps_working(tmp_path, monkeypatch, raised):
    """A memory filesystem smaller than the budget (the fault run: 20 MB tmpfs, 4 GiB budget): ENOSPC evicts and
    shrinks the budget to what the filesystem holds; writes go on instead of failing until a restart. safetensors
    reports a full disk as its own error type (the fault run found entries never written for that)."""
    from collections import namedtuple

    from safetensors import SafetensorError

    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 40, 1 << 40)
    real, real_usage = store_mod.save_file, store_mod.shutil.disk_usage
    usage = namedtuple("usage", "total used free")

    def disk_usage(p):  # the memory tier's filesystem holds three entries
        if str(p).startswith(str(s.mem_dir)):
            return usage(3 * one, s.tier_bytes()["mem"], 3 * one - s.tier_bytes()["mem"])
        return real_usage(p)

    def save(arrays, path, metadata=None):
        if s.tier_bytes()["mem"] + one > 3 * one:
            if raised == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device", path)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(arrays, path, metadata=metadata)

    monkeypatch.setattr(store_mod, "save_file", save)
    monkeypatch.setattr(store_mod.shutil, "disk_usage", disk_usage)
    written = [s.put(f"k{i}", rows(i), {}) is not None for i in range(10)]
    assert all(written) and one <= s.mem_bytes < 3 * one and s.stats.inserts == 10
    assert s.tier_bytes()["mem"] <= s.mem_bytes and s.locate("k0") == "disk" and s.locate("k9") == "mem"


def test_the_budget_starts_within_the_filesystems_free_space(tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: usage(20 << 20, 0, 20 << 20))
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 4 << 30, 1 << 40)
    assert s.mem_bytes == 20 << 20


def test_errors_in_background_promotion_are_caught_and_counted(tmp_path, monkeypatch):
    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", int(one * 1.5), 1 << 30)
    s.put("a", rows(1), {})
    s.put("b", rows(2), {})
    assert s.locate("a") == "disk"
    hooked = []
    monkeypatch.setattr(threading, "excepthook", lambda args: hooked.append(args))

    def fail(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(s, "_copy_atomic", fail)
    assert s.prefetch("a") == "disk"
    s.wait_promotion("a")
    assert not hooked and s.stats.errors >= 1 and s.health.degraded["mem"]
    assert s.open("a") is None  # a miss: the request runs in full
