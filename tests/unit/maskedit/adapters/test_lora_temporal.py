"""LoRA adapters with temporal reuse (Flux Fill ``tiny``, ``sdxl-tiny``; float32 CPU): requests under different
adapter sets, some reusing their middle blocks (a cache hit among them), share one denoiser call per step and equal
each alone: the rows that run a middle block carry their own requests' deltas."""

import json
from dataclasses import replace

import numpy as np
import pytest

from maskedit import samples
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.local import denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from tests.conftest import atol, png
from tests.unit.maskedit.adapters.lora_models import model_with_library

STEPS = 5
SIZE = 128
A = [("attn-mlp-r16", 0.8), ("attn-r4", -0.5)]
B = [("attn-r64", 0.6)]


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny"])
def test_adapter_sets_with_and_without_reuse_in_one_call_equal_each_alone(preset, tmp_path):
    s = model_with_library(tmp_path / "m", preset)
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    pre, runner = Preprocessor(s, store=store), ModelRunner(s)
    unet = preset != "tiny"
    reuse = json.dumps({"policy": "steps", "steps": [0, 1, 3], **({"fn": 1, "bn": 1} if unet else {})})
    tpl = samples.template(SIZE, SIZE, seed=43)

    def x(loras=None, mask=0.2, seed=50, **kw):
        lo = json.dumps([{"name": n, "scale": w} for n, w in loras]) if loras else None
        m = samples.mask(SIZE, SIZE, mask, "box", seed=seed) if mask else np.zeros((SIZE, SIZE), np.uint8)
        return denoise_inputs(pre(png(tpl), png(m), parse_params(s, "a red hat", steps=STEPS, loras=lo,
                                                                   guidance=7.5 if unet else 12.0, **kw)))

    rt = CacheRuntime(runner.family.cache_hooks(runner.transformer), store)
    eng = DenoiseEngine(ModelRunner(s, transformer=runner.transformer, cache=rt))
    try:
        run_job(eng, x(A, mask=0, register=True))
        rt.flush()
        xs = [x(A, temporal=reuse), replace(x(B, seed=51, temporal=reuse), cache_key=None),
              replace(x(None, seed=52), cache_key=None), replace(x(A, seed=53), cache_key=None)]
        alone = [run_job(eng, xi) for xi in xs]
    finally:
        eng.shutdown()
    assert alone[0].cache.status == "hit" and "R" in alone[0].temporal.info()["temporal_steps"]
    r = ModelRunner(s, transformer=runner.transformer, cache=rt)
    jobs = [DenoiseJob(xi) for xi in xs]
    for j in jobs:
        r.prepare(j)
    while not all(j.done for j in jobs):
        assert len(r.groups([j for j in jobs if not j.done])) == 1
        r.step([j for j in jobs if not j.done])
    for j in jobs:
        r.release(j, True)
    rt.close()
    for j, ref in zip(jobs, alone):  # per-row GEMMs round apart from one request's (as test_lora_cache)
        np.testing.assert_allclose(j.result(), ref.result(), atol=atol(s, 1e-4), rtol=0)
        if j.temporal is not None:
            assert j.temporal.outcomes == ref.temporal.outcomes
