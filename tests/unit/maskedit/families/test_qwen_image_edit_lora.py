"""LoRA adapters on Qwen-Image-Edit through the adapter path: served results equal stock Diffusers (the pipeline's
``QwenImageLoraLoaderMixin``: ``load_lora_weights`` + ``set_adapters``), and cache hits under an adapter equal the
same request computed in full (the masked path adds the deltas)."""

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit import samples
from maskedit.adapters import merge
from maskedit.adapters.build import write_library
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.local import LocalEditor
from maskedit.settings import load_settings
from maskedit_lab.harness.baselines import cache_policy
from tests.conftest import atol, png

from .qwen_util import SIZE, load, tiny_model

STEPS = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    family, pipe = tiny_model(tmp_path_factory)
    d = tmp_path_factory.mktemp("qwen-lora")
    write_library(family.model_dir, family, pipe.transformer, out=d / "loras", seed=3)
    base = load_settings()
    s = load_settings({"MASKEDIT_MODEL_DIR": str(family.model_dir), "MASKEDIT_DTYPE": base.dtype,
                       "MASKEDIT_DEVICE": base.device, "MASKEDIT_LORA_DIR": str(d / "loras"),
                       "MASKEDIT_LORA_HOST_DIR": str(d / "lora-host")})
    store = ActivationStore(d / "mem", d / "disk", 1 << 30, 1 << 30)
    ed = LocalEditor(s, store=store)
    runtimes = {p: CacheRuntime(family.cache_hooks(ed.runner.transformer), store, policy=cache_policy(p))
                for p in ("all_y", "all_kv")}
    merge.merger_for(ed.runner.transformer).mode = "never"  # the unmerged deltas: what the masked path adds
    yield s, ed, runtimes
    ed.runner.cache = None  # the runtimes are closed here, once
    ed.close()
    for rt in runtimes.values():
        rt.close()


def stock_latents(s, adapters, tpl, mask, seed):
    pipe = load(s.model_dir)
    for name, _ in adapters:
        pipe.load_lora_weights(str(s.adapters / name), weight_name="pytorch_lora_weights.safetensors",
                               adapter_name=name)
    pipe.set_adapters([n for n, _ in adapters], [w for _, w in adapters])
    return pipe(image=tpl, prompt="a red hat", mask_image=Image.fromarray(mask), strength=1.0,
                num_inference_steps=STEPS, true_cfg_scale=1.0, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent").images[0].numpy()


def test_equals_stock_diffusers_with_the_same_adapters(served):
    s, ed, _ = served
    adapters = [("attn-mlp-r16", 0.7), ("attn-r64", -0.4)]
    tpl, mask = samples.template(SIZE, SIZE, seed=1), samples.mask(SIZE, SIZE, 0.25, "box", seed=1)
    _, _, job = ed.edit(png(tpl), png(mask), "a red hat", seed=5, steps=STEPS, guidance=1.0, raw_output=True,
                        template_seed=5, loras=adapters, use_cache=False)
    ref = stock_latents(s, adapters, tpl, mask, 5)
    np.testing.assert_allclose(job.result(), ref, atol=atol(s, 1e-5), rtol=0)
    _, _, plain = ed.edit(png(tpl), png(mask), "a red hat", seed=5, steps=STEPS, guidance=1.0, raw_output=True,
                          template_seed=5, use_cache=False)
    assert np.abs(plain.result() - job.result()).max() > 1e-3, "the adapters changed nothing"


def test_hits_under_an_adapter_equal_full_computation(served):
    """The template run records under the adapter set's key; y and kv hits with its mask reproduce it."""
    s, ed, runtimes = served
    tpl, mask = samples.template(SIZE, SIZE, seed=7), samples.mask(SIZE, SIZE, 0.25, "box", seed=7)
    adapters = [("attn-mlp-r8", 0.9)]
    kw = dict(seed=2, steps=STEPS, guidance=1.0, raw_output=True, template_seed=2, loras=adapters)
    _, _, full = ed.edit(png(tpl), png(mask), "a red hat", use_cache=False, **kw)
    statuses = []
    for name in ("all_y", "all_y", "all_kv"):  # the first records, then hits
        ed.runner.cache = runtimes[name]
        _, _, job = ed.edit(png(tpl), png(mask), "a red hat", **kw)
        runtimes[name].flush()
        np.testing.assert_allclose(job.result(), full.result(), atol=atol(s, 1e-5), rtol=0)
        statuses.append((job.cache.status, set(job.cache.modes)))
    assert statuses == [("record", {"full"}), ("hit", {"y"}), ("hit", {"kv"})]
