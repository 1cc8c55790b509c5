"""Killing a process while it records leaves the store consistent, and the next request works."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

from maskedit import samples
from maskedit.families.flux_fill.cache import FluxCacheHooks
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore, open_file
from maskedit.local import LocalEditor
from tests.conftest import png

CHILD = textwrap.dedent("""
    import os, sys, time
    import maskedit.cache.store as store_module
    from maskedit import samples
    from maskedit.families.flux_fill.cache import FluxCacheHooks
    from maskedit.cache.runtime import CacheRuntime
    from maskedit.cache.store import ActivationStore
    from maskedit.local import LocalEditor
    from tests.conftest import png
    save, writes = store_module.save_file, []

    def torn_fourth_write(tensors, filename, metadata=None):  # the 4th entry stops half written: kill it there
        save(tensors, filename, metadata=metadata)
        writes.append(filename)
        if len(writes) == 4:
            with open(filename, "r+b") as f:
                f.truncate(os.path.getsize(filename) // 2)
            print("writing", flush=True)
            time.sleep(600)

    store_module.save_file = torn_fourth_write
    store = ActivationStore(sys.argv[1], sys.argv[2], 1 << 30, 1 << 30)
    ed = LocalEditor(cache=lambda t: CacheRuntime(FluxCacheHooks.of(t), store), store=store)
    tpl = png(samples.template(256, 256, seed=31))
    mask = png(samples.mask(256, 256, 0.2, "blob", seed=1))
    print("ready", flush=True)
    for i in range(10_000):  # every template seed is a new entry: records continuously
        ed.edit(tpl, mask, "a hat", steps=3, template_seed=i)
""")


def test_kill_while_recording(tmp_path, settings):
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mem), str(disk)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"ready"
        assert child.stdout.readline().strip() == b"writing"  # three entries stored, the fourth torn mid-write
        assert list(mem.glob(".tmp-*"))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    store = ActivationStore(mem, disk, 1 << 30, 1 << 30)  # sweeps the dead writer's temporary files
    entries = list(mem.glob("*.safetensors"))
    assert len(entries) >= 3
    for p in entries:  # every visible entry is complete and verifies
        info, arrays, _ = open_file(p, verify=True)
        assert arrays["y"].shape[0] == 3 and info["key"] == p.stem
    assert not list(mem.glob(".tmp-*"))
    ed = LocalEditor(settings, cache=lambda t: CacheRuntime(FluxCacheHooks.of(t), store), store=store)
    try:
        tpl = png(samples.template(256, 256, seed=31))
        out, p, job = ed.edit(tpl, png(samples.mask(256, 256, 0.1, "box", seed=2)), "a hat", steps=3,
                              template_seed=0)
        assert job.cache.status == "hit" and out[:8] == b"\x89PNG\r\n\x1a\n"
        out, p, job = ed.edit(tpl, png(np.full((256, 256), 255, np.uint8)), "a hat", steps=3, template_seed=10**6)
        assert job.cache.status == "full" or job.cache.status == "record"
    finally:
        ed.close()
