"""Activation caching through the served ensemble: register, hit, opt out, disk promotion, metrics."""

import re
import shutil
import time
import urllib.request

import numpy as np

from maskedit import samples


def _edit_until_hit(client, tpl, mask, timeout=30.0, **kw):
    deadline = time.time() + timeout
    while True:  # the recording is written in the background right after the template run answers
        r = client.edit(tpl, mask, "a hat", **kw)
        if r.info["cache_hit"] or time.time() > deadline:
            return r
        time.sleep(0.2)


def test_register_then_edits_hit(client, server):
    tpl = samples.template(256, 256, seed=41)
    reg = client.register_template(tpl, steps=3)
    assert reg.info["cache"] == "record" and reg.info["register"]
    assert np.array_equal(np.asarray(reg.image), np.asarray(tpl))  # nothing edited: the template comes back
    mask = samples.mask(256, 256, 0.15, "blob", seed=4)
    r = _edit_until_hit(client, tpl, mask, steps=3, seed=5)
    assert r.info["cache_hit"] and r.info["cached_blocks"] and r.info["computed_tokens"] < r.info["tokens"]
    assert r.info["computed_tokens"] == r.info["masked_tokens"]  # a registered entry is valid everywhere
    assert r.info["cache_source"] == "store" and r.info["full_steps"] == 0
    assert r.info["instance"] == reg.info["instance"]  # which server denoised (one here)
    off = client.edit(tpl, mask, "a hat", steps=3, seed=5, use_cache=False)
    assert off.info["cache"] == "off"
    far = mask == 0
    assert np.array_equal(np.asarray(r.image)[far][:100], np.asarray(off.image)[far][:100])  # template kept


def test_entry_on_disk_is_promoted_while_queued(client, server):
    tpl = samples.template(256, 256, seed=42)
    mask = samples.mask(256, 256, 0.1, "box", seed=4)
    client.register_template(tpl, steps=2)
    r = _edit_until_hit(client, tpl, mask, steps=2)
    assert r.info["cache_hit"]
    mem = server.env["MASKEDIT_CACHE_MEM_DIR"]
    disk = server.env["MASKEDIT_CACHE_DISK_DIR"]
    from pathlib import Path

    moved = 0
    for p in Path(mem).glob("*.safetensors"):  # as LRU eviction would
        shutil.move(str(p), str(Path(disk) / p.name))
        moved += 1
    assert moved
    r = client.edit(tpl, mask, "a hat", steps=2)
    assert r.info["cache_hit"]
    assert list(Path(mem).glob("*.safetensors"))


def test_cache_metrics_on_the_metrics_port(client, server):
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    hits = re.search(r'maskedit_cache_requests_total\{outcome="hit"\} (\d+)', text)
    assert hits and int(hits.group(1)) >= 1
    assert re.search(r'maskedit_cache_bytes\{tier="mem"\} \d', text)
    inserts = re.search(r'maskedit_cache_events_total\{event="inserts",model="masked_denoise",store="activations"\} '
                        r'(\d+)', text)
    assert inserts and int(inserts.group(1)) >= 1  # entries written by the earlier tests' template runs
    cpu = re.search(r'maskedit_cache_write_cpu_seconds_total\{kind="record"\} ([0-9.e+-]+)', text)
    assert cpu and float(cpu.group(1)) > 0  # and the CPU those writes took


def _corrupt_events(server) -> dict[str, float]:
    """``maskedit_cache_events_total{event="corrupt"}`` per counting process (model)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^maskedit_cache_events_total\{event="corrupt",model="(\w+)",store="activations"\} ([0-9.e+]+)$', text, re.M)}


def test_a_corrupt_entry_found_by_pre_processing_is_counted_in_the_shared_metric(client, server):
    """Pre-processing promotes a disk entry while its request queues and verifies it first; a corrupt one is
    discarded there. It used to be logged only: the corrupt counter was exported by the denoise process alone."""
    from pathlib import Path

    tpl = samples.template(256, 256, seed=43)
    mask = samples.mask(256, 256, 0.1, "box", seed=4)
    mem, disk = Path(server.env["MASKEDIT_CACHE_MEM_DIR"]), Path(server.env["MASKEDIT_CACHE_DISK_DIR"])
    others = set(mem.glob("*.safetensors"))  # other tests' entries: left alone
    client.register_template(tpl, steps=2)
    assert _edit_until_hit(client, tpl, mask, steps=2).info["cache_hit"]
    before = _corrupt_events(server)
    ours = set(mem.glob("*.safetensors")) - others
    assert ours
    for p in ours:  # evicted, and then damaged on disk
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2:len(raw) // 2 + 4096] = bytes(4096)
        (disk / p.name).write_bytes(bytes(raw))
        p.unlink()
    r = client.edit(tpl, mask, "a hat", steps=2)
    assert not r.info["cache_hit"]  # a miss: the corrupt entry is never used
    deadline = time.time() + 3 * 5 + 10  # pre-processing's metrics refresh on a timer (MASKEDIT_METRICS_SYNC_S)
    while time.time() < deadline and _corrupt_events(server).get("preprocess", 0) <= before.get("preprocess", 0):
        time.sleep(0.5)
    after = _corrupt_events(server)
    assert after.get("preprocess", 0) > before.get("preprocess", 0), (before, after)
