"""The store after a storage fault is gone: back to full strength without waiting for a write that may never come
(a shrunk budget grows back, degraded flags clear), and eviction never carries a corrupt entry to disk."""

import errno
import logging
import os
import shutil
from collections import namedtuple

import pytest

from maskedit.cache import store as store_mod
from maskedit.cache.store import ActivationStore

from .test_store_faults import rows, size_of

usage = namedtuple("usage", "total used free")


def test_a_budget_shrunk_by_enospc_grows_back_when_the_space_returns(tmp_path, monkeypatch, caplog):
    """The fault run: a 3 MB filesystem over the memory tier shrank a 4 MB budget below one entry, and after the
    space came back the tier stayed there, degraded, every request a miss. The probe restores it."""
    one = size_of(tmp_path, rows())
    configured = 6 * one
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", configured, 1 << 40)
    fs = {"size": 2 * one}  # the filesystem under the memory tier: two entries' room while the fault lasts
    real_save, real_usage = store_mod.save_file, store_mod.shutil.disk_usage

    def disk_usage(p):
        if str(p).startswith(str(s.mem_dir)):
            held = s.tier_bytes()["mem"]
            return usage(fs["size"], held, max(0, fs["size"] - held))
        return real_usage(p)

    def save(arrays, path, metadata=None):
        if str(path).startswith(str(s.mem_dir)) and s.tier_bytes()["mem"] + one > fs["size"]:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_save(arrays, path, metadata=metadata)

    monkeypatch.setattr(store_mod, "save_file", save)
    monkeypatch.setattr(store_mod.shutil, "disk_usage", disk_usage)
    for i in range(4):
        s.put(f"k{i}", rows(i), {})
    shrunk = s.mem_bytes
    assert shrunk < 2 * one and s.health.degraded["mem"], (shrunk, s.health.degraded)
    s.probe()  # the filesystem is still small: nothing to give back
    assert s.mem_bytes == shrunk and s.health.degraded["mem"]

    fs["size"] = 1 << 40  # the space is back (the small filesystem unmounted)
    with caplog.at_level(logging.INFO, logger="maskedit"):
        s.probe()
    assert s.mem_bytes == configured and s.health.degraded["mem"] is None, (s.mem_bytes, s.health.degraded)
    m = s.metrics()
    assert m["mem_budget"] == m["mem_budget_configured"] == configured and m["recovered"] >= 1
    assert any("budget restored" in r.getMessage() for r in caplog.records)
    for i in range(4, 9):  # and it holds entries again: the hot set stays in memory
        s.put(f"k{i}", rows(i), {})
    assert sum(s.locate(f"k{i}") == "mem" for i in range(9)) >= 5


def test_a_budget_grows_only_as_far_as_the_filesystem_has_room(tmp_path, monkeypatch):
    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 8 * one, 1 << 40)
    room = {"free": 8 * one}
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: usage(1 << 40, 0, room["free"]))
    s.mem_bytes = one  # as after ENOSPC
    room["free"] = 4 * one
    s.probe()
    assert 3 * one <= s.mem_bytes < 4 * one  # grown, within what the filesystem holds (with the margin)
    room["free"] = 100 * one
    s.probe()
    assert s.mem_bytes == 8 * one  # never above the configured budget


@pytest.fixture
def broken_disk(tmp_path):
    """Make the disk tier's path unwritable for root too (a file where its directory was), and give it back."""
    disk = tmp_path / "disk"

    class Fault:
        def break_(self):
            shutil.move(disk, tmp_path / "disk-away")
            disk.write_text("not a directory")

        def fix(self):
            disk.unlink()
            shutil.move(tmp_path / "disk-away", disk)

    return Fault()


def test_a_degraded_disk_tier_is_cleared_by_the_probe_without_another_write(tmp_path, broken_disk):
    """The fault run: a disk tier made read-only then writable again stayed flagged until some later write. Now
    the probe clears it once a write succeeds there, and not before."""
    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", int(one * 2.5), 1 << 40)
    s.put("a", rows(1), {})
    broken_disk.break_()
    for i in range(2, 5):  # evictions to the disk tier fail: its entries are dropped, the tier degraded
        s.put(f"k{i}", rows(i), {})
    assert s.health.degraded["disk"] and s.stats.dropped >= 1
    s.probe()
    assert s.health.degraded["disk"], "cleared while the tier still cannot write"
    broken_disk.fix()
    recovered = s.stats.recovered
    s.probe()  # no entry written since
    assert s.health.degraded["disk"] is None and s.stats.recovered == recovered + 1
    assert not [p for p in (tmp_path / "disk").iterdir()], "the probe left a file behind"


def test_the_probe_costs_nothing_while_healthy(tmp_path, monkeypatch):
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    monkeypatch.setattr(store_mod.tier_health, "probe_write", lambda d: pytest.fail("probed a healthy tier"))
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda p: pytest.fail("statvfs at full budget"))
    s.probe()


def test_eviction_verifies_an_entry_before_it_goes_to_disk(tmp_path, caplog):
    """A memory entry corrupted in place (times put back) used to be copied to the disk tier by eviction and
    caught only at its promotion. Now eviction discards it: counted, logged, never on disk."""
    one = size_of(tmp_path, rows())
    s = ActivationStore(tmp_path / "mem", tmp_path / "disk", int(one * 1.5), 1 << 40)
    path = s.put("a", rows(1), {})
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(os.urandom(4096))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level(logging.WARNING, logger="maskedit"):
        s.put("b", rows(2), {})  # "a" is evicted
    assert s.locate("a") is None and not (tmp_path / "disk" / "a.safetensors").exists()
    assert s.stats.corrupt == 1 and s.stats.evictions == 0 and s.stats.dropped == 0
    assert any(r.getMessage() == "corrupt activation entry discarded" and "eviction" in r.fields["reason"]
               for r in caplog.records)
    s.put("c", rows(3), {})  # a healthy entry still moves to disk
    assert s.locate("b") == "disk" and s.stats.evictions == 1
