"""Activation store: tiers, LRU, crash safety, corruption, concurrent writers, several processes."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from maskedit.cache.store import ActivationStore, open_file


def mk(tmp_path, mem=10_000_000, disk=10_000_000):
    return ActivationStore(tmp_path / "mem", tmp_path / "disk", mem, disk)


def arrays(seed=0, n=1000):
    rng = np.random.default_rng(seed)
    return {"y": rng.standard_normal((2, 3, n), dtype=np.float32), "valid": np.ones(n, np.uint8)}


def test_put_open_roundtrip_zero_copy(tmp_path):
    s = mk(tmp_path)
    a = arrays()
    s.put("k1", a, {"steps": 2})
    e = s.open("k1")
    assert e.tier == "mem" and e.meta["steps"] == 2 and isinstance(e.arrays["y"], np.memmap)
    np.testing.assert_array_equal(e.arrays["y"], a["y"])
    assert s.open("nope") is None
    assert (s.stats.hits, s.stats.misses) == (1, 1)


def test_replaced_or_evicted_entries_are_unmapped(tmp_path):
    """A RAM filesystem keeps an unlinked file's pages while it is mapped: the store must not keep old versions."""
    one = os.path.getsize(mk(tmp_path / "probe").put("x", arrays(), {}))
    s = mk(tmp_path, mem=int(one * 2.5))
    old = s.open("k") if s.put("k", arrays(1), {}) else None
    s.put("k", arrays(2), {})  # a heal rewrites the entry
    new = s.open("k")
    assert new is not old and not any(e is old for e in s._mapped.values())
    assert [e.key for e in s._mapped.values()] == ["k"]
    s.put("b", arrays(3), {})
    s.put("c", arrays(4), {})  # "k" is evicted to disk
    assert s.locate("k") == "disk"
    s.open("b")
    assert sorted(e.key for e in s._mapped.values()) == ["b"]


def test_what_a_process_remembers_of_entries_is_bounded(tmp_path, monkeypatch):
    """Template churn writes new files all day: the mapped entries stay capped."""
    from maskedit.cache import store as store_mod

    monkeypatch.setattr(store_mod, "MAPPED_CAP", 3)
    s = mk(tmp_path, mem=100_000_000)
    for i in range(12):
        s.put(f"k{i}", arrays(i, n=10), {})
        assert s.open(f"k{i}") is not None
    assert len(s._mapped) <= 3
    assert s.open("k11") is not None and s.open("k0") is not None  # forgotten ones are mapped again, not lost


def test_lru_eviction_to_disk_and_promotion(tmp_path):
    one = os.path.getsize(mk(tmp_path / "probe").put("x", arrays(), {}))
    s = mk(tmp_path, mem=int(one * 2.5))
    for i, k in enumerate(["a", "b", "c"]):
        s.put(k, arrays(i), {})
        time.sleep(0.01)
    assert s.locate("a") == "disk" and s.locate("b") == "mem" and s.locate("c") == "mem"
    assert s.stats.evictions == 1
    e = s.open("a")  # promoted back; now "b" is the least recently used
    np.testing.assert_array_equal(e.arrays["y"], arrays(0)["y"])
    assert s.locate("a") == "mem" and s.locate("b") == "disk" and s.stats.promotions == 1
    m = s.metrics()
    assert m["mem_entries"] == 2 and m["disk_entries"] == 1 and m["mem_bytes"] <= s.mem_bytes


def test_prefetch_promotes_in_background(tmp_path):
    s = mk(tmp_path, mem=1)  # everything is evicted at once
    s.put("a", arrays(), {})
    assert s.locate("a") == "disk"
    s.mem_bytes = 10_000_000
    assert s.prefetch("a") == "disk"
    s.wait_promotion("a")
    assert s.locate("a") == "mem"


def test_disk_tier_is_trimmed(tmp_path):
    s = mk(tmp_path, mem=1, disk=1)
    s.put("a", arrays(), {})
    assert s.locate("a") is None and s.stats.dropped == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_entry_is_a_miss_and_removed(tmp_path, damage):
    s = mk(tmp_path)
    path = s.put("k", arrays(), {})
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 100]
    elif damage == "flip":
        raw[-10] ^= 0xFF
    else:
        raw = bytearray(b"\x00" * 64)
    path.write_bytes(bytes(raw))
    fresh = mk(tmp_path)  # a new process has not verified it yet
    assert fresh.open("k") is None and fresh.stats.corrupt == 1 and not path.exists()


def _writer(mem, disk, key, ready):
    import maskedit.cache.store as store_mod

    real = store_mod.save_file

    def stalled_save(arrays, path, metadata=None):  # write the file for real, then hang before returning
        real(arrays, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)  # and leave it half-written, as a crash mid-write would
        ready.set()
        time.sleep(600)

    store_mod.save_file = stalled_save
    s = ActivationStore(mem, disk, 1 << 40, 1 << 40)
    s.put(key, {"y": np.ones((4, 1024, 1024), np.float32)}, {})


def test_killed_writer_leaves_no_visible_entry(tmp_path):
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_writer, args=(tmp_path / "mem", tmp_path / "disk", "big", ready))
    p.start()
    assert ready.wait(30)
    assert list((tmp_path / "mem").glob(".tmp-*")), "the writer is mid-write"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    s = mk(tmp_path)
    assert s.locate("big") is None and s.open("big") is None
    assert not list((tmp_path / "mem").glob(".tmp-*")), "the dead writer's temporary file is swept"
    s.put("small", arrays(), {})  # the store keeps working
    assert s.open("small") is not None


def _record(mem, disk, seed, barrier):
    s = ActivationStore(mem, disk, 1 << 40, 1 << 40)
    barrier.wait()
    for _ in range(5):
        s.put("same", arrays(seed, 200_000), {"writer": seed})


def test_concurrent_writers_of_the_same_key(tmp_path):
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_record, args=(tmp_path / "mem", tmp_path / "disk", i, barrier)) for i in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    info, arr, _ = open_file(tmp_path / "mem" / "same.safetensors", verify=True)
    np.testing.assert_array_equal(arr["y"], arrays(info["writer"], 200_000)["y"])


def _reader(mem, disk, q):
    s = ActivationStore(mem, disk, 1 << 40, 1 << 40)
    e = s.open("shared")
    q.put(float(e.arrays["y"].sum()) if e else None)


def test_other_processes_read_the_same_entry(tmp_path):
    s = mk(tmp_path)
    s.put("shared", arrays(3), {})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reader, args=(tmp_path / "mem", tmp_path / "disk", q))
    p.start()
    assert q.get(timeout=60) == pytest.approx(float(arrays(3)["y"].sum()), rel=1e-6)
    p.join(10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_entries_keep_the_models_dtype_checksummed_and_mapped(tmp_path, dtype):
    """A bf16 model's entries are bf16 on disk (half the bytes of float32), read back as bf16 without a copy."""
    s = mk(tmp_path, mem=100_000_000)
    y = torch.randn(2, 3, 1000).to(dtype)
    s.put("k", {"y": y, "valid": np.ones(1000, np.uint8)}, {"steps": 2})
    s._mapped.clear()  # as in a process that has not read it yet
    e = s.open("k")
    assert e.dtypes["y"] == dtype and e.tensor("y").dtype == dtype
    assert torch.equal(e.tensor("y"), y)
    assert e.tensor("y").data_ptr() == e.arrays["y"].ctypes.data  # a view on the mapping
    assert os.path.getsize(e.path) < 1000 * 6 * torch.finfo(dtype).bits // 8 + 4096
    info, arr, _ = open_file(e.path, verify=True)
    assert arr.dtypes["y"] == dtype


def test_a_corrupt_bf16_entry_is_a_miss(tmp_path):
    s = mk(tmp_path, mem=100_000_000)
    path = s.put("k", {"y": torch.randn(4, 100).bfloat16(), "valid": np.ones(100, np.uint8)}, {})
    raw = bytearray(path.read_bytes())
    raw[-50] ^= 0xFF
    path.write_bytes(bytes(raw))
    s._mapped.clear()
    assert s.open("k") is None and s.stats.corrupt == 1


def test_disk_tier_is_bounded_by_the_free_space_it_finds(tmp_path, monkeypatch):
    """A cap larger than the disk: the tier keeps to its share of what the filesystem has, not the cap."""
    import shutil
    from collections import namedtuple

    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1, 1 << 40, disk_free_fraction=0.5)  # 1 TiB cap
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100_000, 0, 60_000))  # 60 kB free
    for i in range(6):
        s.put(f"k{i}", arrays(i), {})  # ~24 kB each, all evicted to disk (memory budget 1 byte)
    held = sum(st.st_size for _, st in s.entries("disk"))
    assert 0 < held <= s.disk_limit(held) <= 0.5 * (60_000 + held)
    assert len(s.entries("disk")) < 6  # the oldest were dropped to keep within the free space
