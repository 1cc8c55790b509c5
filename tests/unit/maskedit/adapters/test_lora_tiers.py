"""The adapter cache's tiers and loading off the critical path (tiny Flux Fill, float32 CPU, no server):
a second process reads the host tier instead of converting, both tiers keep their byte budgets in LRU order, a
corrupt host entry is discarded and rebuilt from the library file, a file replaced since the request was checked
is refused; in the denoise loop a request whose adapters load slowly waits while another keeps stepping, a failing
load fails only its request, and early start patches adapters in after they arrive."""

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from maskedit.adapters import convert, skeleton
from maskedit.adapters.build import write_library
from maskedit.adapters.host_cache import AdapterHostCache, entry_key
from maskedit.adapters.library import AdapterLibrary, ResolvedRef
from maskedit.adapters.prefetch import AdapterPrefetcher
from maskedit.adapters.runtime import AdapterRuntime
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.errors import Cancelled, InvalidInput
from maskedit.families import family_for

SPECS = (("a4", 4, "attn", False), ("m8", 8, "attn+mlp", False), ("a16", 16, "attn", False))


@pytest.fixture(scope="module")
def lib(settings, runner, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-tiers") / "lib"
    write_library(settings.model_dir, family_for(settings.model_dir), runner.transformer, out=d, seed=7, specs=SPECS)
    return d


@pytest.fixture
def tiers(settings, runner, lib, tmp_path):
    """A maker of denoise-process runtimes sharing one host directory (as two Triton instances on a host do)."""
    fam = family_for(settings.model_dir)
    library = AdapterLibrary(lib)

    def make(host_bytes=1 << 30, device_bytes=1 << 30, host_dir=tmp_path / "host"):
        host = AdapterHostCache(host_dir, host_bytes)
        return AdapterRuntime(fam, runner.transformer, library, device_bytes, host,
                              skeleton.fingerprint(settings, fam))

    make.library = library
    make.scratch = tmp_path
    make.ref = lambda name, scale=1.0: ResolvedRef(name, scale, library.file(name).digest)
    return make


def _same(a, b):
    assert a.modules.keys() == b.modules.keys()
    for k, m in a.modules.items():
        n = b.modules[k]
        assert torch.equal(m.A, n.A) and torch.equal(m.B, n.B) and (m.alpha, m.r, m.rslora) == (n.alpha, n.r, n.rslora)


def test_a_second_instance_reads_the_host_tier_without_converting(tiers, monkeypatch):
    first = tiers()
    ref = tiers.ref("m8", 0.8)
    a = first.get(ref)
    assert first.stats.get("device", "miss") == 1 and first.stats.get("library", "load") == 1
    assert first.host.contains(entry_key("m8", ref.digest, first.fingerprint))
    second = tiers()  # another process: its own device tier, the same host directory

    def no_conversion(*a, **k):
        raise AssertionError("the second instance converted the library file")

    monkeypatch.setattr(convert, "load", no_conversion)
    b = second.get(ref)
    assert second.stats.get("host", "hit") == 1 and second.stats.get("host", "load") == 1
    _same(a, b)
    assert second.get(ref) is b and second.stats.get("device", "hit") == 1  # now in its device tier


def test_prefetch_from_preprocessing_fills_the_host_tier(settings, tiers, tmp_path, monkeypatch):
    """Pre-processing converts on a weightless (meta) skeleton of the denoiser; denoise then reads the host tier."""
    host = AdapterHostCache(tmp_path / "host", 1 << 30)
    pre = AdapterPrefetcher(settings, family_for(settings.model_dir), tiers.library, host)
    ref = tiers.ref("a16")
    (f,) = pre.start((ref,))
    assert f.result(60) is True and pre.start((ref,)) == [] and host.stats.get("host", "hit") == 1
    reference = convert.load(tiers.library.file("a16"), family_for(settings.model_dir), tiers().denoiser)
    monkeypatch.setattr(convert, "load", lambda *a, **k: pytest.fail("denoise converted a prefetched adapter"))
    rt = tiers()
    _same(rt.get(ref), reference)
    assert rt.stats.get("host", "hit") == 1


def test_a_conversion_in_progress_in_another_process_is_waited_for(tiers, monkeypatch):
    ref = tiers.ref("a16")
    converted = tiers(host_dir=tiers.scratch / "elsewhere").get(ref)
    rt = tiers()
    key = entry_key("a16", ref.digest, rt.fingerprint)
    assert rt.host.claim(key) and not rt.host.claim(key)  # "another process" is converting it (a live pid)
    monkeypatch.setattr(convert, "load", lambda *a, **k: pytest.fail("converted while another process was"))
    got = []
    t = threading.Thread(target=lambda: got.append(rt.get(ref)))
    t.start()
    t.join(0.5)
    assert t.is_alive(), "it should wait for the other conversion"
    rt.host.put(key, converted)
    rt.host.release(key)
    t.join(30)
    _same(got[0], converted)
    assert rt.stats.get("host", "hit") == 1 and rt.host.wait(key, 0.0)  # entry there, no marker left


def test_both_tiers_evict_least_recently_used_within_their_budgets(tiers):
    rt = tiers()
    refs = {n: tiers.ref(n) for n in ("a4", "m8", "a16")}
    for n in ("a4", "m8"):
        rt.get(refs[n])
    rt.host.get(entry_key("a4", refs["a4"].digest, rt.fingerprint))  # a4 used after m8
    rt.get(refs["a16"])
    sizes = {p.name.split("--")[0]: s.st_size for p, s in rt.host.entries()}
    assert sizes.keys() == {"a4", "m8", "a16"}
    rt.host.budget = sum(sizes.values()) - 1  # one entry must go: the least recently used
    rt.host.evict()
    assert {p.name.split("--")[0] for p, _ in rt.host.entries()} == {"a4", "a16"}
    assert rt.host.resident_bytes() <= rt.host.budget and rt.stats.get("host", "eviction") == 1
    # a new entry makes room for itself the same way
    rt.host.budget = sizes["a4"] + sizes["a16"] + sizes["m8"] // 2
    rt.host.put(entry_key("m8", refs["m8"].digest, rt.fingerprint), rt.get(refs["m8"]))
    assert rt.host.resident_bytes() <= rt.host.budget and rt.host.contains(
        entry_key("m8", refs["m8"].digest, rt.fingerprint))
    # the device tier: its own budget, LRU by use
    nb = {n: rt.cached(r, count=False).nbytes for n, r in refs.items()}
    dev = tiers(device_bytes=nb["a4"] + nb["a16"])
    dev.get(refs["a4"])
    dev.get(refs["m8"])  # over budget: a4 (least recently used) goes
    assert dev.cached(refs["a4"], count=False) is None
    dev.get(refs["a4"])  # m8 goes
    dev.get(refs["a4"])
    dev.get(refs["a16"])
    assert dev.cached(refs["m8"], count=False) is None and dev.resident_bytes <= dev.budget
    assert dev.cached(refs["a4"], count=False) is not None and dev.stats.get("device", "eviction") == 2


def test_a_host_tier_opened_with_a_smaller_budget_shrinks_at_once(tiers, monkeypatch):
    """A restart with a lower ``MASKEDIT_LORA_HOST_BYTES`` evicts (least recently used first) when the tier is
    opened, not at its next write: a host whose adapters are all cached may never write again."""
    first = tiers()
    refs = {n: tiers.ref(n) for n in ("a4", "m8", "a16")}
    for n in ("a4", "m8", "a16"):
        first.get(refs[n])
    first.host.get(entry_key("a4", refs["a4"].digest, first.fingerprint))  # a4 used last: m8 is the oldest
    sizes = {p.name.split("--")[0]: s.st_size for p, s in first.host.entries()}
    assert sizes.keys() == {"a4", "m8", "a16"}
    same = tiers(host_bytes=sum(sizes.values()))  # a budget it fits in: nothing goes (the negative control)
    assert same.host.resident_bytes() == sum(sizes.values()) and same.stats.get("host", "eviction") == 0
    monkeypatch.setattr(convert, "load", lambda *a, **k: pytest.fail("converted: the survivors should be read"))
    smaller = tiers(host_bytes=sizes["a4"] + sizes["a16"])  # opened, nothing written
    assert {p.name.split("--")[0] for p, _ in smaller.host.entries()} == {"a4", "a16"}
    assert smaller.host.resident_bytes() <= smaller.host.budget and smaller.stats.get("host", "eviction") == 1
    for n in ("a4", "a16"):  # the survivors are intact and served from the host tier
        _same(smaller.get(refs[n]), first.cached(refs[n], count=False))
    assert smaller.stats.get("host", "hit") == 2


def test_a_corrupt_host_entry_is_discarded_and_rebuilt_from_the_library(tiers):
    ref = tiers.ref("m8")
    good = tiers().get(ref)
    rt = tiers()
    path = rt.host._path(entry_key("m8", ref.digest, rt.fingerprint))
    raw = bytearray(path.read_bytes())
    raw[-9] ^= 0xFF  # a bit flip in the last array's bytes: structure intact, checksum wrong
    path.write_bytes(bytes(raw))
    again = rt.get(ref)
    assert rt.stats.get("host", "corrupt") == 1 and rt.stats.get("library", "load") == 1
    _same(again, good)
    assert tiers().host.get(entry_key("m8", ref.digest, rt.fingerprint)) is not None  # rewritten, verified


def test_a_library_file_replaced_since_the_check_is_refused(tiers, lib, tmp_path):
    ref = tiers.ref("a4")
    f = tiers.library.file("a4").path
    saved = f.read_bytes()
    try:
        f.write_bytes(tiers.library.file("a16").path.read_bytes())  # replaced with other content
        with pytest.raises(InvalidInput) as e:
            tiers(host_dir=tmp_path / "fresh").get(ref)
        assert e.value.field == "LORAS" and "'a4' was replaced" in str(e.value)
        assert tiers.ref("a4").digest != ref.digest
    finally:
        f.write_bytes(saved)


class Outcome:
    def __init__(self, inputs, **kw):
        self.done, self.error, self.event = None, None, threading.Event()
        self.job = DenoiseJob(inputs, on_done=lambda j: (setattr(self, "done", j), self.event.set()),
                              on_error=lambda j, e: (setattr(self, "error", e), self.event.set()), **kw)


@pytest.fixture(scope="module")
def inputs(make_inputs):
    return make_inputs(3)


def _slow_runner(settings, runner, lib, tmp_path, **kw):
    """A runner whose adapter loads wait for ``gate`` (a slow disk, a large adapter)."""
    s = replace(settings, lora_dir=lib, lora_host_dir=tmp_path / "host", **kw)
    r = ModelRunner(s, transformer=runner.transformer)
    gate, load = threading.Event(), r.adapters._load
    r.adapters._load = lambda ref: (gate.wait(60), load(ref))[1]
    return r, gate


def test_a_slow_adapter_load_never_stalls_the_other_requests(settings, runner, lib, tmp_path, inputs, tiers):
    r, gate = _slow_runner(settings, runner, lib, tmp_path)
    eng = DenoiseEngine(r, max_batch=4)
    try:
        slow = Outcome(replace(inputs, loras=(tiers.ref("m8", 0.9),)))
        gone = Outcome(replace(inputs, loras=(tiers.ref("a16"),)), is_cancelled=lambda: True)
        plain = Outcome(inputs)
        for o in (slow, gone, plain):
            eng.submit(o.job)
        assert plain.event.wait(60) and plain.error is None and plain.done.step_index == 3
        assert gone.event.wait(60) and isinstance(gone.error, Cancelled)  # cancelled while its load waited
        assert not slow.event.is_set() and slow.job.step_index == 0 and slow.job.started_at is None
        assert eng.stats()["loading_adapters"] == 1
        gate.set()
        assert slow.event.wait(60) and slow.error is None and slow.job.adapters
        again = Outcome(replace(inputs, loras=(tiers.ref("m8", 0.9),)))  # device hit: no wait at all
        eng.submit(again.job)
        assert again.event.wait(60) and again.job.adapter_load is None
    finally:
        gate.set()
        eng.shutdown()
    np.testing.assert_array_equal(slow.done.result(), again.done.result())
    assert np.abs(slow.done.result() - plain.done.result()).max() > 1e-3, "the late adapter was not applied"


def test_a_failing_load_fails_only_its_request(settings, runner, lib, tmp_path, inputs, tiers):
    r, gate = _slow_runner(settings, runner, lib, tmp_path)
    gate.set()
    eng = DenoiseEngine(r, max_batch=4)
    try:
        bad = Outcome(replace(inputs, loras=(ResolvedRef("a4", 1.0, "0" * 16),)))  # not the file's digest
        good = Outcome(replace(inputs, loras=(tiers.ref("a4", 0.5),)))
        plain = Outcome(inputs)
        for o in (bad, good, plain):
            eng.submit(o.job)
        assert all(o.event.wait(60) for o in (bad, good, plain))
    finally:
        eng.shutdown()
    assert isinstance(bad.error, InvalidInput) and bad.error.field == "LORAS" and "'a4'" in str(bad.error)
    assert good.error is None and plain.error is None and good.done.step_index == plain.done.step_index == 3


def test_early_start_denoises_first_and_patches_the_adapters_in(settings, runner, lib, tmp_path, inputs, tiers):
    r, gate = _slow_runner(settings, runner, lib, tmp_path, lora_early_start=True)
    eng = DenoiseEngine(r, max_batch=4)
    try:
        # its load ends between its first and second steps
        early = Outcome(replace(inputs, loras=(tiers.ref("m8", 0.9),)),
                        on_step=lambda j: j.step_index == 1 and (gate.set(), j.adapter_load.result(60)))
        eng.submit(early.job)
        assert early.event.wait(60) and early.error is None
        exact = Outcome(replace(inputs, loras=(tiers.ref("m8", 0.9),)))  # loaded now: from its first step
        eng.submit(exact.job)
        assert exact.event.wait(60)
    finally:
        gate.set()
        eng.shutdown()
    assert early.job.adapters_from_step == 1 and exact.job.adapters_from_step == 0
    diff = np.abs(early.done.result() - exact.done.result()).max()
    assert 0 < diff, "early start should differ from the exact path"
