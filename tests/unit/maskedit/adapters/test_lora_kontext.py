"""LoRA adapters on FLUX.1 Kontext, through the shared adapter path: served results equal stock
``FluxKontextInpaintPipeline`` with ``load_lora_weights`` + ``set_adapters``, and a hit under the recorded adapter set
(reference rows included) equals its plain run."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit import samples
from maskedit.adapters import merge
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.local import LocalEditor, denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit_lab.harness.baselines import cache_policy
from tests.conftest import atol, plain, png
from tests.unit.maskedit.adapters.lora_models import STEPS, model_with_library, stock_pipeline

SIZE = 256  # the model size: Kontext runs at the template's own size (no auto-resize)
ADAPTERS = [("attn-mlp-r16", 0.8), ("attn-r4", -0.5)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    s = model_with_library(tmp_path_factory.mktemp("kontext-lora"), "kontext-tiny")
    ed = LocalEditor(s)
    merge.merger_for(ed.runner.transformer).mode = "never"  # PEFT's unmerged layers are the reference
    yield s, ed
    ed.close()


def test_equals_stock_kontext_with_the_same_adapters(model):
    s, ed = model
    tpl, mask = samples.template(SIZE, SIZE, seed=1), samples.mask(SIZE, SIZE, 0.25, "box", seed=1)
    _, p, job = ed.edit(png(tpl), png(mask), "a red hat", seed=5, steps=STEPS, guidance=2.5, raw_output=True,
                        template_seed=5, loras=ADAPTERS)
    pipe = stock_pipeline(s, ADAPTERS)
    ref = pipe(prompt="a red hat", image=tpl, mask_image=Image.fromarray(mask), height=p.model_h, width=p.model_w,
               max_area=p.model_h * p.model_w, _auto_resize=False, num_inference_steps=STEPS, strength=1.0,
               guidance_scale=2.5, max_sequence_length=s.max_sequence_length,
               generator=torch.Generator("cpu").manual_seed(5), output_type="latent").images[0]
    np.testing.assert_allclose(job.result(), ref.float().numpy(), atol=atol(s, 1e-5), rtol=0)
    _, _, without = ed.edit(png(tpl), png(mask), "a red hat", seed=5, steps=STEPS, guidance=2.5, raw_output=True,
                            template_seed=5)
    assert np.abs(without.result() - job.result()).max() > 1e-3, "the adapter changed nothing"


def test_hits_under_the_recorded_adapter_set_are_exact(model, tmp_path):
    s, ed = model
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    tpl, mask = samples.template(SIZE, SIZE, seed=2), samples.mask(SIZE, SIZE, 0.25, "box", seed=2)
    params = parse_params(s, "a red hat", steps=STEPS, guidance=2.5,
                          loras=json.dumps([{"name": n, "scale": w} for n, w in ADAPTERS]))
    x = denoise_inputs(ed.pre.__class__(s, store=store)(png(tpl), png(mask), params))
    ref = plain(ed.runner, x).result()
    statuses = []
    for policy in ("planner", "all_y", "all_kv"):  # the first records, then hits
        rt = CacheRuntime(ed.runner.family.cache_hooks(ed.runner.transformer), store, policy=cache_policy(policy))
        eng = DenoiseEngine(ModelRunner(s, transformer=ed.runner.transformer, cache=rt))
        try:
            job = run_job(eng, x)
            rt.flush()
        finally:
            eng.shutdown()
            rt.close()
        np.testing.assert_allclose(job.result(), ref, atol=atol(s, 1e-5), rtol=0)
        statuses.append(job.cache.status)
        if job.cache.status == "hit":
            assert job.cache.info()["computed_tokens"] == int(np.asarray(x.token_mask).sum())
    assert statuses == ["record", "hit", "hit"]
