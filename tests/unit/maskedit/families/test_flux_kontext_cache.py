"""Mask-aware caching on FLUX.1 Kontext: FLUX.1's block hooks with reference rows, driven by the unchanged
``CacheRuntime`` and a real store (tiny model, float32, CPU)."""

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from maskedit.families.flux_kontext import FluxKontextFamily
from maskedit.families.flux_kontext.tiny import build

from .cache_util import policy_runtimes
from .klein_util import cached, plain
from .kontext_util import box_mask, job, kparams, load, template

STEPS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("kontext-cache")
    model = build(d / "tiny", "kontext-tiny", seed=0)
    family, pipe = FluxKontextFamily(model), load(model)
    with policy_runtimes(family.cache_hooks(pipe.transformer), d) as rt:
        yield family, pipe, rt


def make(family, pipe, img, mask, key=None, register=False, seed=0, reference=None):
    j = job(family, pipe, img, mask, kparams(seed=seed, steps=STEPS), reference=reference)
    j.inputs.cache_key, j.inputs.register = key, register
    return j


@pytest.mark.parametrize("policy", ["all_y", "all_kv"])
def test_template_run_then_same_request_is_exact(env, policy):
    """A repeated identical request (reference image included) reproduces the template run bit for bit, computing
    only its masked tokens: every reference row comes from the entry."""
    family, pipe, rt = env
    img, mask, ref = template(seed=5), box_mask(), template(seed=15)
    key = f"same-{policy}"
    first = make(family, pipe, img, mask, key, reference=ref)
    recorded = cached(family, pipe, rt("planner"), first)
    assert first.cache.status == "record"
    assert torch.equal(recorded, plain(family, pipe, make(family, pipe, img, mask, reference=ref)))
    entry = rt("planner").store.open(key, count=False)
    n = first.inputs.latents.shape[0]
    assert entry.meta["tokens"] == n + first.inputs.reference.shape[0] and entry.meta["reference_tokens"] == n
    again = make(family, pipe, img, mask, key, reference=ref)
    hit = cached(family, pipe, rt(policy), again)
    assert again.cache.status == "hit" and int(again.cache.idx_c.numel()) == int(again.inputs.token_mask.sum())
    assert torch.equal(hit, recorded)


@pytest.mark.parametrize("reference", [False, True])
def test_other_mask_hit_is_close_to_full_computation(env, reference):
    family, pipe, rt = env
    img = template(seed=6)
    ref = template(seed=16) if reference else None
    key = f"other-{reference}"
    cached(family, pipe, rt("planner"), make(family, pipe, img, np.zeros((256, 256), np.uint8), key, register=True,
                                             reference=ref))
    mask = box_mask(box=(96, 32, 176, 144))
    j = make(family, pipe, img, mask, key, seed=9, reference=ref)
    hit = cached(family, pipe, rt("planner"), j)
    assert j.cache.status == "hit" and int(j.cache.idx_c.numel()) == int(j.inputs.token_mask.sum())
    full = plain(family, pipe, make(family, pipe, img, mask, seed=9, reference=ref))
    m = torch.from_numpy(np.asarray(j.inputs.token_mask))
    assert torch.equal(hit[0, ~m], full[0, ~m])  # outside the mask both are the template (the blend)
    a = np.asarray(family.decode(pipe, hit, 256, 256))
    b = np.asarray(family.decode(pipe, full, 256, 256))
    ssim = structural_similarity(a, b, channel_axis=2, data_range=255)
    noctx = cached(family, pipe, rt("noctx"), make(family, pipe, img, mask, key, seed=9, reference=ref))
    err, err_noctx = (float((x[0, m] - full[0, m]).abs().mean()) for x in (hit, noctx))
    print(f"reference={reference}: ssim {ssim:.4f} mean|d| masked {err:.2e} (noctx {err_noctx:.2e})")
    assert ssim >= 0.98 and err < err_noctx
