"""The store applies its budgets when it is opened, not only at its next write: a server restarted with a smaller
``MASKEDIT_CACHE_MEM_BYTES`` (or ``_DISK_BYTES``) must not keep the old amount in ``/dev/shm`` until something is
written (a sized ``/dev/shm`` fills: ENOSPC, or the pod is OOM-killed)."""

import logging
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from maskedit.cache import store as store_mod
from maskedit.cache import tmp_files
from maskedit.cache.file_lock import locked
from maskedit.cache.store import ActivationStore, open_file

KEYS = ("a", "b", "c", "d")
OPENED = "activation store brought within its budgets on open"


def arrays(seed, n=1000):
    rng = np.random.default_rng(seed)
    return {"y": rng.standard_normal((2, 3, n), dtype=np.float32), "valid": np.ones(n, np.uint8)}


def store(d, mem=1 << 30, disk=1 << 30):
    return ActivationStore(d / "mem", d / "disk", mem, disk)


def filled(d, keys=KEYS, mem=1 << 30, disk=1 << 30):
    """A store holding ``keys`` (written in that order: the first is the least recently used); their sizes."""
    s = store(d, mem, disk)
    sizes = {}
    for i, k in enumerate(keys):
        sizes[k] = os.path.getsize(s.put(k, arrays(i), {"seed": i}))
        time.sleep(0.01)  # distinct access times
    return s, sizes


def snapshot(d):
    """Every entry file of both tiers with its identity and LRU time: what 'nothing changed' compares."""
    return {(t, p.name): (st.st_ino, st.st_size, st.st_atime_ns, st.st_mtime_ns)
            for t in ("mem", "disk") for p in (d / t).glob("*.safetensors") for st in [p.stat()]}


def intact(d, key):
    """The entry for ``key`` in either tier, verified whole and equal to what was written."""
    [path] = [p for t in ("mem", "disk") for p in [d / t / f"{key}.safetensors"] if p.exists()]
    info, arr, _ = open_file(path, verify=True)
    np.testing.assert_array_equal(arr["y"], arrays(info["seed"])["y"])
    return path.parent.name


def opened_records(caplog):
    return [r for r in caplog.records if r.getMessage() == OPENED]


def test_reopened_with_a_smaller_memory_budget_it_demotes_least_recently_used_first(tmp_path, caplog):
    first, sizes = filled(tmp_path)
    first.open("a")  # used last: "b" and then "c" are now the oldest
    budget = sizes["a"] + sizes["d"] + sizes["c"] // 2  # room for two entries, not three
    with caplog.at_level(logging.INFO, logger="maskedit"):
        smaller = store(tmp_path, mem=budget)  # opened, nothing written
    assert {k: smaller.locate(k) for k in KEYS} == {"a": "mem", "b": "disk", "c": "disk", "d": "mem"}
    held = smaller.tier_bytes()
    assert held["mem"] == sizes["a"] + sizes["d"] <= budget
    assert smaller.stats.evictions == 2 and smaller.stats.dropped == 0 and smaller.metrics()["evictions"] == 2
    for k in KEYS:
        intact(tmp_path, k)
    [rec] = opened_records(caplog)  # logged once, with counts and bytes
    assert rec.fields == {"demoted": 2, "dropped": 0, "mem_bytes_before": sum(sizes.values()),
                          "mem_bytes": held["mem"], "mem_budget": budget, "disk_bytes_before": 0,
                          "disk_bytes": sizes["b"] + sizes["c"], "disk_budget": rec.fields["disk_budget"],
                          "within_budget": True}
    e = smaller.open("b")  # a demoted entry is served again, promoted back
    assert e is not None and e.tier == "mem" and smaller.stats.promotions == 1
    np.testing.assert_array_equal(e.arrays["y"], arrays(1)["y"])


def test_reopened_with_the_same_budget_nothing_changes(tmp_path, caplog):
    """The negative control: a store within its budgets is left exactly as it was (no file moved, rewritten or
    touched, nothing counted or logged)."""
    _, sizes = filled(tmp_path, mem=1 << 30)
    tight = sum(sizes.values())  # exactly what it holds: fits
    before = snapshot(tmp_path)
    with caplog.at_level(logging.INFO, logger="maskedit"):
        for mem in (1 << 30, tight):
            s = store(tmp_path, mem=mem)
            assert (s.stats.evictions, s.stats.dropped, s.stats.errors) == (0, 0, 0)
    assert snapshot(tmp_path) == before and not opened_records(caplog)


def test_reopened_with_a_smaller_disk_budget_it_drops_the_oldest_disk_entries(tmp_path):
    _, sizes = filled(tmp_path, mem=1)  # a 1-byte memory tier: every entry is written to the disk tier
    assert {p.stem for p in (tmp_path / "disk").glob("*.safetensors")} == set(KEYS)
    smaller = store(tmp_path, mem=1, disk=sizes["c"] + sizes["d"])
    assert {k: smaller.locate(k) for k in KEYS} == {"a": None, "b": None, "c": "disk", "d": "disk"}
    assert smaller.stats.dropped == 2 and smaller.stats.evictions == 0
    for k in ("c", "d"):
        intact(tmp_path, k)


def test_a_corrupt_entry_demoted_on_open_is_discarded_not_carried_to_disk(tmp_path):
    """Demotion verifies an entry before it copies it (issue 47: it copied bytes as they were, and only promotion
    found them): a corrupt one is discarded and counted there, never served."""
    first, _ = filled(tmp_path)
    path = first.mem_dir / "a.safetensors"  # the least recently used: the one demoted
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    s = store(tmp_path, mem=sum(p.stat().st_size for p in first.mem_dir.glob("*.safetensors")) - 1)
    assert s.locate("a") is None and s.stats.corrupt == 1 and s.stats.evictions == 0
    assert s.open("a") is None and s.stats.corrupt == 1
    for k in ("b", "c", "d"):
        intact(tmp_path, k)


def test_opening_waits_for_the_inter_process_lock(tmp_path):
    """Another process evicting or promoting holds the lock: the opening store shrinks the tiers after it, not
    alongside it."""
    _, sizes = filled(tmp_path)
    before = snapshot(tmp_path)
    opened = []
    with locked(tmp_path / "mem" / ".lock"):  # as another process would hold it (a separate open file: flock)
        t = threading.Thread(target=lambda: opened.append(store(tmp_path, mem=sizes["d"])))
        t.start()
        t.join(0.5)
        assert t.is_alive() and snapshot(tmp_path) == before  # nothing moved while the lock is held
    t.join(30)
    assert not t.is_alive() and opened[0].stats.evictions == 3
    assert {p.stem for p in (tmp_path / "mem").glob("*.safetensors")} == {"d"}


def _open_at_once(d, mem, barrier, q):
    barrier.wait()
    s = store(d, mem=mem)
    q.put((s.stats.evictions, s.stats.dropped, s.stats.errors))


def test_two_stores_opened_at_once_end_within_budget_with_every_entry_intact(tmp_path):
    keys = tuple(f"k{i}" for i in range(8))
    _, sizes = filled(tmp_path, keys)
    budget = sizes["k6"] + sizes["k7"]
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_at_once, args=(tmp_path, budget, barrier, q)) for _ in range(2)]
    for p in procs:
        p.start()
    counts = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(c[0] for c in counts) == 6 and all(c[1:] == (0, 0) for c in counts)  # demoted once between them
    mem = {p.stem for p in (tmp_path / "mem").glob("*.safetensors")}
    disk = {p.stem for p in (tmp_path / "disk").glob("*.safetensors")}
    assert mem == {"k6", "k7"} and disk == set(keys) - mem
    assert sum(p.stat().st_size for p in (tmp_path / "mem").glob("*.safetensors")) <= budget
    assert not list((tmp_path / "mem").glob(".tmp-*")) and not list((tmp_path / "disk").glob(".tmp-*"))
    for k in keys:
        intact(tmp_path, k)


def test_opening_keeps_a_live_writers_temporary_files(tmp_path):
    """Opening sweeps the temporary files of dead writers only: a live one's (an eviction's copy in another process
    opening at the same time) stays, or its entry would be lost. The writer's pid is the name's first field after the prefix (maskedit.cache.tmp_files)."""
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    host = tmp_files._HOST
    names = {"live": f".tmp-{os.getpid()}-{host}-abcdef12-k0.safetensors",
             "dead": f".tmp-{dead}-{host}-abcdef12-k1.safetensors"}
    for t in ("mem", "disk"):
        (tmp_path / t).mkdir(parents=True, exist_ok=True)
        for name in names.values():
            (tmp_path / t / name).write_bytes(b"partial")
    store(tmp_path)
    for t in ("mem", "disk"):
        assert (tmp_path / t / names["live"]).exists() and not (tmp_path / t / names["dead"]).exists()


def test_a_storage_error_on_open_is_logged_and_counted_never_raised(tmp_path, monkeypatch, caplog):
    filled(tmp_path)

    def unusable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(store_mod, "locked", unusable)
    with caplog.at_level(logging.WARNING, logger="maskedit"):
        s = store(tmp_path, mem=1)
    assert s.stats.errors == 1 and s.metrics()["errors"] == 1
    assert [r.fields["error"] for r in caplog.records
            if r.getMessage() == "activation store could not apply its budgets on open"] == ["PermissionError"]


@pytest.mark.parametrize("budget", ["smaller", "same"])
def test_a_reopened_store_keeps_serving(tmp_path, budget):
    first, sizes = filled(tmp_path)
    s = store(tmp_path, mem=sizes["d"] if budget == "smaller" else 1 << 30)
    for i, k in enumerate(KEYS):
        e = s.open(k)
        assert e is not None
        np.testing.assert_array_equal(e.arrays["y"], arrays(i)["y"])
    assert s.put("new", arrays(9), {"seed": 9}) is not None and s.tier_bytes()["mem"] <= s.mem_bytes
