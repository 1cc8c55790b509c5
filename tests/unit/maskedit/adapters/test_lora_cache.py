"""LoRA adapters with the mask-aware activation cache (Flux Fill ``tiny``, ``sdxl-tiny``; float32 CPU): a template
recorded under an adapter set serves its hits exactly; another set, another scale or none misses that entry; hits
of different adapter sets, a recording and a plain request share one denoiser call per step and equal each alone;
the opt-in base reuse (``MASKEDIT_CACHE_LORA_BASE_REUSE``) reads the no-adapter entry and is approximate."""

import json
from dataclasses import replace

import numpy as np
import pytest

from maskedit import samples
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.families import family_for
from maskedit.local import denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit.settings import load_settings
from maskedit_lab.harness.baselines import cache_policy
from tests.conftest import atol, plain, png
from tests.unit.maskedit.adapters.lora_models import model_with_library

STEPS = 3
SIZE = 128
A = [("attn-mlp-r16", 0.8), ("attn-r4", -0.5)]
B = [("attn-r64", 0.6)]
C = [("attn-mlp-r8", -0.7)]
EMPTY = np.zeros((SIZE, SIZE), np.uint8)


@pytest.fixture(scope="module", params=["tiny", "sdxl-tiny"])
def env(request, tmp_path_factory):
    s = model_with_library(tmp_path_factory.mktemp(request.param), request.param)
    sd = tmp_path_factory.mktemp("store")
    store = ActivationStore(sd / "mem", sd / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(s, store=store)
    runner = ModelRunner(s)
    engines = {}

    def runtime(policy="planner", reuse=False):
        if (policy, reuse) not in engines:
            rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store, policy=cache_policy(policy),
                              lora_base_reuse=reuse)
            engines[(policy, reuse)] = (DenoiseEngine(ModelRunner(s, transformer=runner.transformer, cache=rt)), rt)
        return engines[(policy, reuse)]

    def run(x, policy="planner", reuse=False):
        eng, rt = runtime(policy, reuse)
        job = run_job(eng, x)
        rt.flush()
        return job

    def prepared(tpl, mask, loras=None, **kw):
        g = 12.0 if request.param == "tiny" else 7.5
        lo = json.dumps([{"name": n, "scale": w} for n, w in loras]) if loras else None
        params = parse_params(s, "a red hat", steps=STEPS, guidance=g, loras=lo, **kw)
        return denoise_inputs(pre(png(tpl), png(mask), params))

    yield s, runner, store, runtime, run, prepared
    for eng, rt in engines.values():
        eng.shutdown()
        rt.close()


def test_hits_under_the_recorded_adapter_set_are_exact(env):
    s, runner, store, _, run, prepared = env
    tpl, mask = samples.template(SIZE, SIZE, seed=41), samples.mask(SIZE, SIZE, 0.2, "box", seed=41)
    x = prepared(tpl, mask, A)
    first = run(x)
    assert first.cache.status == "record" and store.locate(x.cache_key) == "mem"  # not `off` any more
    ref = plain(runner, x).result()
    np.testing.assert_allclose(first.result(), ref, atol=atol(s, 1e-6), rtol=0)  # recording changes nothing
    m = np.asarray(x.token_mask, bool)
    without = plain(runner, replace(x, loras=())).result()
    assert np.abs(without[m] - ref[m]).max() > 1e-2, "the adapters changed nothing where the hit computes"
    for policy in ("planner", "all_y", "all_kv"):
        again = run(x, policy)
        jc = again.cache
        assert jc.status == "hit" and jc.idx_c.numel() == int(m.sum()) and set(jc.modes) - {"full"}, jc.modes
        # The masked tokens are computed through the cached block paths, the rest read from the entry: without
        # the adapters' deltas there the masked tokens would be off by the adapters' effect (> 1e-2, above).
        np.testing.assert_allclose(again.result(), ref, atol=atol(s, 1e-5), rtol=0)


def test_another_set_scale_or_none_misses_and_equals_its_plain_run(env):
    s, runner, store, _, run, prepared = env
    tpl, mask = samples.template(SIZE, SIZE, seed=42), samples.mask(SIZE, SIZE, 0.2, "blob", seed=42)
    xa = prepared(tpl, EMPTY, A, register=True)
    assert run(xa).cache.status == "record"
    for loras in (B, [(A[0][0], 0.4), A[1]], None):
        x = prepared(tpl, mask, loras)
        assert x.cache_key != xa.cache_key
        job = run(x)
        assert job.cache.status == "record", f"{loras} used the entry recorded under {A}"
        np.testing.assert_allclose(job.result(), plain(runner, x).result(), atol=atol(s, 1e-6), rtol=0)


def test_a_step_mixes_hits_of_several_adapter_sets_a_recording_and_a_plain_request(env):
    """Five requests, one denoiser call per step: cached hits under no adapters, A and B; a template recording
    under C; an uncached request under A. Each equals its run alone. On Flux Fill a sixth request at another
    resolution (under B) joins the same call: a packed call, every row through the cached block path."""
    s, runner, store, runtime, run, prepared = env
    packed = runner.family.name == "flux_fill"
    tpl = samples.template(SIZE, SIZE, seed=43)
    for loras in (None, A, B):
        assert run(prepared(tpl, EMPTY, loras, register=True)).cache.status == "record"
    xs = [prepared(tpl, samples.mask(SIZE, SIZE, 0.15 + 0.05 * i, "box", seed=50 + i), lo)
          for i, lo in enumerate((None, A, B))]
    xs.append(prepared(samples.template(SIZE, SIZE, seed=44), samples.mask(SIZE, SIZE, 0.2, "box", seed=1), C))
    xs.append(prepared(samples.template(SIZE, SIZE, seed=45), samples.mask(SIZE, SIZE, 0.3, "blob", seed=2), A,
                       use_cache=False))
    if packed:
        xs.append(prepared(samples.template(SIZE, SIZE * 3 // 4, seed=46), samples.mask(SIZE, SIZE * 3 // 4, 0.3,
                                                                                       "box", seed=3), B))
        assert (xs[-1].model_w, xs[-1].model_h) != (xs[0].model_w, xs[0].model_h)
    _, rt = runtime()
    r = ModelRunner(s, transformer=runner.transformer, cache=rt)
    jobs = [DenoiseJob(x) for x in xs]
    for j in jobs:
        r.prepare(j)
    assert [j.cache.status for j in jobs] == ["hit", "hit", "hit", "record", "off", "record"][:len(jobs)]
    calls = 0
    while not all(j.done for j in jobs):
        calls += len(r.groups([j for j in jobs if not j.done]))
        r.step([j for j in jobs if not j.done])
    for j in jobs:
        r.release(j, True)
    rt.flush()
    assert calls == STEPS, "the requests should share one call per step"
    alone = [run(x).result() for x in xs[:3]] + [plain(runner, x).result() for x in xs[3:]]
    # As the mixed-adapter batch of test_lora: per-row GEMMs round differently from one request's, and an SDXL
    # UNet's guidance amplifies that; the adapters move latents by far more (> 1e-2).
    for j, ref in zip(jobs, alone):
        np.testing.assert_allclose(j.result(), ref, atol=atol(s, 5e-5), rtol=0)


def test_base_reuse_is_opt_in_and_approximate(env):
    s, runner, store, _, run, prepared = env
    assert load_settings().cache.lora_base_reuse is False
    assert load_settings({"MASKEDIT_CACHE_LORA_BASE_REUSE": "1"}).cache.lora_base_reuse is True
    tpl, mask = samples.template(SIZE, SIZE, seed=46), samples.mask(SIZE, SIZE, 0.2, "box", seed=46)
    base = prepared(tpl, EMPTY, None, register=True)
    run(base)
    x = prepared(tpl, mask, A)
    assert x.base_cache_key == base.cache_key != x.cache_key
    reused = run(x, reuse=True)
    jc = reused.cache
    assert jc.status == "hit" and jc.base_reuse and jc.info()["cache_base_reuse"] and jc.patch is None
    assert store.locate(x.cache_key) is None  # no template pass under A
    exact = plain(runner, x).result()
    m = np.asarray(x.token_mask, bool)
    without = plain(runner, replace(x, loras=())).result()
    err = np.abs(reused.result()[m] - exact[m]).mean()
    assert 0 < err < np.abs(without[m] - exact[m]).mean()  # approximate, but it carries the adapters
    # Off (the default) the same request records its own entry, exactly; once there, reuse prefers it.
    own = run(x)
    assert own.cache.status == "record" and not own.cache.base_reuse
    np.testing.assert_allclose(own.result(), exact, atol=atol(s, 1e-6), rtol=0)
    again = run(x, reuse=True)
    assert again.cache.status == "hit" and not again.cache.base_reuse
    np.testing.assert_allclose(again.result(), exact, atol=atol(s, 1e-5), rtol=0)


def _every_block_linear(denoiser, rank: int, seed: int) -> dict:
    """PEFT-format factors on every linear layer of the transformer blocks: on FLUX.2 that includes the single
    blocks' fused ``to_qkv_mlp_proj``, whose key/value features the cached path projects on their own."""
    import torch

    g = torch.Generator("cpu").manual_seed(seed)
    sd = {}
    for name, m in denoiser.named_modules():
        if isinstance(m, torch.nn.Linear) and name.split(".")[0] in ("transformer_blocks", "single_transformer_blocks"):
            sd[f"{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
            sd[f"{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * (0.3 / rank ** 0.5)
    return sd


def test_klein_hits_under_an_adapter_on_every_block_linear_are_exact(tmp_path):
    s = model_with_library(tmp_path, "klein-tiny", library=False)
    d = s.model_dir
    fam = family_for(d)
    sd = _every_block_linear(fam.load_denoiser(s), 8, 3)
    assert any("to_qkv_mlp_proj" in k for k in sd)
    fam.pipeline_class().save_lora_weights(d / "loras" / "every", transformer_lora_layers=sd)
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(s, store=store)
    runner = ModelRunner(s)
    tpl, mask = samples.template(SIZE, SIZE, seed=47), samples.mask(SIZE, SIZE, 0.25, "box", seed=47)
    x = denoise_inputs(pre(png(tpl), png(mask), parse_params(s, "a red hat", steps=STEPS,
                                                               loras='[{"name": "every", "scale": 0.9}]')))
    ref = plain(runner, x).result()
    m = np.asarray(x.token_mask, bool)
    assert np.abs(plain(runner, replace(x, loras=())).result()[m] - ref[m]).max() > 1e-2
    statuses = []
    for policy in ("all_y", "all_y", "all_kv"):  # the first records, then hits (y: the fused projection's slice)
        rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store, policy=cache_policy(policy))
        eng = DenoiseEngine(ModelRunner(s, transformer=runner.transformer, cache=rt))
        try:
            job = run_job(eng, x)
            rt.flush()
        finally:
            eng.shutdown()
            rt.close()
        np.testing.assert_allclose(job.result(), ref, atol=atol(s, 1e-5), rtol=0)
        statuses.append((job.cache.status, set(job.cache.modes)))
    assert statuses == [("record", {"full"}), ("hit", {"y"}), ("hit", {"kv"})]
