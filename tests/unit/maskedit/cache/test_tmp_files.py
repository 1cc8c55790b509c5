"""The temporary files of atomic writes into a host-shared directory: opening a store or the adapter host tier
removes a dead writer's file and never a live writer's (whose copy would otherwise vanish before its rename)."""

import os
import time

from maskedit.adapters.host_cache import AdapterHostCache
from maskedit.cache import tmp_files


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _write(d, name):
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(b"partial")
    return d / name


def test_sweep_keeps_live_writers_and_removes_dead_and_stale_ones(tmp_path):
    live = tmp_files.tmp_path(tmp_path, "k-with-dashes.safetensors")  # a name's own dashes do not move the pid
    live.write_bytes(b"partial")
    host = tmp_files._HOST
    dead = _write(tmp_path, f".tmp-{_dead_pid()}-{host}-abcdef12-k1.safetensors")
    stale = _write(tmp_path, f".tmp-{os.getpid()}-{host}-abcdef12-k2.safetensors")
    other_host = _write(tmp_path, f".tmp-{_dead_pid()}-0000ffff-abcdef12-k3.safetensors")  # another pod's writer
    old = time.time() - tmp_files.STALE_S - 5
    os.utime(stale, (old, old))
    odd = _write(tmp_path, ".tmp-notapid")
    tmp_files.sweep(tmp_path)
    assert live.exists() and not dead.exists() and not stale.exists() and not odd.exists()
    assert other_host.exists()  # its pid means nothing in this pid namespace: removed only once stale
    os.utime(other_host, (old, old))
    tmp_files.sweep(tmp_path)
    assert not other_host.exists()


def test_opening_the_adapter_host_tier_keeps_a_live_writers_copy(tmp_path):
    # the tier once read the pid from the random field, so every process opening it deleted the others' copies
    live = tmp_files.tmp_path(tmp_path / "host", "adapter-key")
    live.parent.mkdir(parents=True)
    live.write_bytes(b"partial")
    dead = _write(tmp_path / "host", f".tmp-{_dead_pid()}-{tmp_files._HOST}-abcdef12-other")
    AdapterHostCache(tmp_path / "host", 1 << 20)
    assert live.exists() and not dead.exists()
