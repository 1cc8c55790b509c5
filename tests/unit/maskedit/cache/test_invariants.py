"""Invariants of mask-aware caching, on the tiny model with a real store (in a temp dir)."""

from dataclasses import replace

import numpy as np
import pytest

from maskedit import samples
from maskedit.families.flux_fill.cache import FluxCacheHooks
from maskedit.cache.runtime import POLICIES, CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.local import denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit_lab.harness.baselines import FIXED_POLICIES, FixedPolicy, cache_policy
from tests.conftest import atol, exact_here, plain, png

STEPS = 3


@pytest.fixture(scope="module")
def env(settings, tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    store = ActivationStore(d / "mem", d / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(settings, store=store)
    runner = ModelRunner(settings)
    hooks = FluxCacheHooks.of(runner.transformer)
    engines = {}

    def run(inputs, policy="planner"):
        if policy not in engines:
            rt = CacheRuntime(hooks, store, policy=cache_policy(policy))
            r = ModelRunner(settings, transformer=runner.transformer, cache=rt)
            engines[policy] = (DenoiseEngine(r), rt)
        eng, rt = engines[policy]
        job = run_job(eng, inputs)
        rt.flush()
        return job

    yield pre, run, store, runner
    for eng, rt in engines.values():
        eng.shutdown()
        rt.close()


def prepared(pre, settings, tpl, mask, **kw):
    params = parse_params(settings, "a hat", steps=STEPS, **kw)
    return denoise_inputs(pre(png(tpl), png(mask), params))


def test_record_then_same_mask_is_exact_in_every_mode(env, settings):
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=21)
    mask = samples.mask(256, 256, 0.2, "box", seed=21)
    x = prepared(pre, settings, tpl, mask)
    first = run(x)
    assert first.cache.status == "record" and store.locate(x.cache_key) == "mem"
    np.testing.assert_array_equal(first.result(), plain(runner, x).result())  # recording changes nothing
    for policy in ("planner", "planner_y", "all_y", "all_kv"):
        again = run(x, policy)
        jc = again.cache
        assert jc.status == "hit" and jc.idx_c.numel() == int(mask_tokens(x).sum())
        # Cached rows are this very run's rows, so computing only the masked tokens reproduces it.
        np.testing.assert_allclose(again.result(), first.result(), atol=atol(settings, 1e-5))


def mask_tokens(x):
    return np.asarray(x.token_mask, bool)


def test_full_mask_on_cached_template_equals_full_computation(env, settings):
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=22)
    run(prepared(pre, settings, tpl, samples.mask(256, 256, 0.1, "blob", seed=1), register=True))
    x = prepared(pre, settings, tpl, np.full((256, 256), 255, np.uint8))
    job = run(x)
    assert job.cache.status == "full"
    np.testing.assert_array_equal(job.result(), plain(runner, x).result())


def test_empty_mask_on_cached_template_equals_the_template_run(env, settings):
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=23)
    reg = prepared(pre, settings, tpl, np.zeros((256, 256), np.uint8), register=True)
    template_run = run(reg)
    assert template_run.cache.status == "record"
    job = run(replace(reg, register=False))  # nothing masked: every block output comes from the store
    jc = job.cache
    assert jc.status == "hit" and jc.idx_c.numel() == 0
    np.testing.assert_array_equal(job.result(), template_run.result())


def test_cache_off_and_miss_give_the_stock_result(env, settings):
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=24)
    x = prepared(pre, settings, tpl, samples.mask(256, 256, 0.3, "blob", seed=2))
    off = run(x, "off")
    assert off.cache.status == "off"
    miss = run(x)
    assert miss.cache.status == "record"
    np.testing.assert_array_equal(off.result(), miss.result())


def test_other_mask_uses_context_better_than_the_shortcut(env, settings):
    """A hit for a new mask approximates the full computation; dropping the cached context is worse."""
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=25)
    run(prepared(pre, settings, tpl, np.zeros((256, 256), np.uint8), register=True))
    x = prepared(pre, settings, tpl, samples.mask(256, 256, 0.2, "blob", seed=5))
    full = plain(runner, x).result()
    m = mask_tokens(x)
    err = {}
    for policy in ("planner", "noctx"):
        job = run(x, policy)
        assert job.cache.status == "hit"
        err[policy] = float(np.abs(job.result()[m] - full[m]).mean())
    assert err["planner"] < err["noctx"]


def test_recording_rows_of_the_edit_are_recomputed_later(env, settings):
    """Tokens the recording request edited are not template context: later hits compute them."""
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=26)
    m0 = samples.mask(256, 256, 0.1, "box", seed=3)
    x0 = prepared(pre, settings, tpl, m0)
    run(x0)
    x1 = prepared(pre, settings, tpl, samples.mask(256, 256, 0.1, "box", seed=4))
    jc = run(x1).cache
    expect = mask_tokens(x0) | mask_tokens(x1)
    assert jc.status == "hit" and jc.idx_c.numel() == int(expect.sum())


def test_settings_in_the_key_miss(env, settings):
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=27)
    mask = samples.mask(256, 256, 0.1, "box", seed=3)
    base = prepared(pre, settings, tpl, mask)
    run(base)
    for kw in ({"guidance": 7.0}, {"template_seed": 9}):
        x = prepared(pre, settings, tpl, mask, **kw)
        assert x.cache_key != base.cache_key and run(x).cache.status == "record"
    x = prepared(pre, settings, tpl, mask, seed=99)  # SEED only varies the masked noise: same entry
    assert x.cache_key == base.cache_key and run(x).cache.status == "hit"


def test_corrupt_entry_falls_back_to_full(env, settings):
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=28)
    x = prepared(pre, settings, tpl, samples.mask(256, 256, 0.1, "box", seed=3))
    run(x)
    path = store.mem_dir / f"{x.cache_key}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    job = run(x)
    assert job.cache.status == "record"  # treated as a miss, recorded afresh
    np.testing.assert_array_equal(job.result(), plain(runner, x).result())


def test_policies_are_known():
    """Serving knows its own policies; the fixed baselines are composed in the lab and accepted as policies."""
    assert set(POLICIES) == {"off", "planner", "planner_y"}
    assert set(FIXED_POLICIES) == {"all_y", "all_kv", "noctx"} and not set(FIXED_POLICIES) & set(POLICIES)
    with pytest.raises(ValueError):
        FixedPolicy("planner")


def test_fused_projections_share_the_blocks_weights_and_leave_their_forward_exact(settings):
    import torch

    from maskedit.families.flux_fill.cache import _FusedInputs, _inputs
    from maskedit.components import load_transformer

    tr = load_transformer(settings)
    block = tr.single_transformer_blocks[0]
    a = block.attn
    x = torch.randn(1, 7, block.norm.linear.in_features, dtype=tr.dtype, device=tr.device)
    before = [m(x).clone() for m in (a.to_q, a.to_k, a.to_v, block.proj_mlp)]
    fused = _inputs(block, dual=False)
    after = [m(x) for m in (a.to_q, a.to_k, a.to_v, block.proj_mlp)]
    for b, c in zip(before, after):
        assert torch.equal(b, c)  # the layers' own calls are unchanged
    if exact_here(settings):
        assert torch.equal(fused(x), torch.cat(after, -1))
    else:  # a GPU may pick another GEMM kernel for the wider stacked weight
        torch.testing.assert_close(fused(x), torch.cat(after, -1), atol=atol(settings, 0), rtol=1e-2)
    # no weight held twice: the layers' parameters are slices of the stacked one
    base = fused.weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == base for m in (a.to_q, a.to_k, a.to_v, block.proj_mlp))
    assert _inputs(block, dual=False) is fused
    with torch.no_grad():  # new weights loaded in place: the stacked weight follows
        a.to_k.weight.add_(1.0)
    again = _inputs(block, dual=False)
    k_rows = slice(a.to_q.weight.shape[0], 2 * a.to_q.weight.shape[0])
    if exact_here(settings):
        assert torch.equal(again(x)[..., k_rows], a.to_k(x))
    else:
        torch.testing.assert_close(again(x)[..., k_rows], a.to_k(x), atol=atol(settings, 0), rtol=1e-2)
    assert isinstance(again, _FusedInputs)


def test_entry_corrupted_in_place_mid_run_is_detected_and_recomputed(env, settings, monkeypatch):
    """Bytes of a stored entry's rows changed in place with the file's times put back (silent disk or memory
    corruption changes neither): the loader's checksum catches them as the block's rows load, the entry is
    discarded, and the request starts again in full: its image is the uncached one, never one from bad bytes."""
    import os

    from maskedit.cache import entry_file

    monkeypatch.setattr(entry_file, "SMALL_BYTES", 4096)  # rows are verified by the loader, not at open
    pre, run, store, runner = env
    tpl = samples.template(256, 256, seed=29)
    x = prepared(pre, settings, tpl, samples.mask(256, 256, 0.2, "box", seed=5))
    assert run(x).cache.status == "record"
    entry = store.open(x.cache_key, count=False)
    path, st = entry.path, entry.path.stat()
    with open(path, "r+b") as f:  # a flipped byte in every block's rows of step 1, whichever the hit reads
        for name in ("y", "k", "v"):
            a = entry.arrays.get(name)
            if a is None or a.ndim < 3:
                continue
            for b in range(a.shape[1]):
                off = int(a[1, b].ctypes.data - entry.mapping.ctypes.data) + a[1, b].nbytes // 2
                f.seek(off)
                f.write(bytes([entry.mapping[off] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = store.stats.corrupt
    edit = prepared(pre, settings, tpl, samples.mask(256, 256, 0.2, "box", seed=6))
    job = run(edit)
    assert job.restarts == 1 and job.cache.info()["cache_corrupt"]
    assert store.stats.corrupt == before + 1
    np.testing.assert_array_equal(job.result(), plain(runner, edit).result())
    again = run(edit)  # the restarted request recorded the entry afresh: later ones hit it
    assert again.cache.status == "hit" and not again.cache.info()["cache_corrupt"]
    np.testing.assert_allclose(again.result(), job.result(), atol=atol(settings, 1e-4))
