"""Mask-aware caching on Qwen-Image-Edit: the family's hooks driven by the unchanged ``CacheRuntime`` and a real store
(tiny model, float32, CPU)."""

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from maskedit.cache.modes import FULL, StepContext
from maskedit.cache.rows import Recorder, RowView
from maskedit.families.qwen_image_edit.cache import QwenEditCacheHooks

from .cache_util import policy_runtimes, run_cached
from .qwen_util import SIZE, box_mask, make, run, runner, template, tiny_model

STEPS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    family, pipe = tiny_model(tmp_path_factory)
    d = tmp_path_factory.mktemp("qwen-cache")
    with policy_runtimes(family.cache_hooks(pipe.transformer), d) as rt:
        yield family, pipe, rt


def cached(family, pipe, runtime, j):
    return run_cached(family, runner(family, pipe), runtime, j)


def plain(family, pipe, j):
    return run(family, runner(family, pipe), [j])[0]


def test_runtime_takes_the_hooks_as_they_are(env):
    family, pipe, rt = env
    runtime = rt("planner")
    cfg = pipe.transformer.config
    assert runtime.kinds == ["dual"] * cfg.num_layers
    assert runtime.dim == cfg.num_attention_heads * cfg.attention_head_dim
    assert QwenEditCacheHooks.of(pipe.transformer) is family.cache_hooks(pipe.transformer)  # attached once


def test_every_block_full_equals_the_plain_forward(env):
    """Through the hooks (a recording row and a plain row in one call, so the hooked path runs) the transformer
    gives exactly its own result."""
    family, pipe, _ = env
    img = template(seed=4)
    base = [make(family, pipe, img, box_mask(), seed=s, prompt=p) for s, p in ((1, "a red hat"), (2, "a blue hat"))]
    nb = len(pipe.transformer.transformer_blocks)
    hooks = family.cache_hooks(pipe.transformer)
    n, dim = hooks.cache_mask(base[0].inputs).size, pipe.transformer.inner_dim  # noisy and reference rows
    rec = Recorder(STEPS, n, dim, dim, list(range(nb)), list(range(nb)))
    ctx_for = lambda js: StepContext([RowView(modes=[FULL] * nb, recorder=rec), None])  # noqa: E731
    hooked = run(family, runner(family, pipe), base, ctx_for)
    reference = run(family, runner(family, pipe), [make(family, pipe, img, box_mask(), seed=s, prompt=p)
                                                   for s, p in ((1, "a red hat"), (2, "a blue hat"))])
    for h, p in zip(hooked, reference):
        assert torch.equal(h, p)


@pytest.mark.parametrize("policy", ["all_y", "all_kv"])
def test_template_run_then_same_mask_hit_is_exact(env, policy):
    """Bit for bit: the hit's cached rows (noisy and reference) are this very run's. Its queries are the text and
    the masked tokens only, and the CPU's attention kernel rounds a row in a short tail of its query blocks (1 to 3
    rows) differently from the same row in a full block: this mask's 87 text + 49 masked queries leave no such tail
    (the default box's 42 would leave one, off by 1e-7)."""
    family, pipe, rt = env
    img, mask = template(seed=5), box_mask(box=(256, 320, 704, 768))
    key = f"same-{policy}"
    first = make(family, pipe, img, mask, key=key)
    recorded = cached(family, pipe, rt("planner"), first)
    assert first.cache.status == "record"
    assert torch.equal(recorded, plain(family, pipe, make(family, pipe, img, mask)))  # recording changes nothing
    again = make(family, pipe, img, mask, key=key)
    hit = cached(family, pipe, rt(policy), again)
    jc = again.cache
    assert int(again.inputs.pooled_embeds[0]) == 87 and int(again.inputs.token_mask.sum()) == 49  # see above
    assert jc.status == "hit" and int(jc.idx_c.numel()) == int(again.inputs.token_mask.sum())
    assert set(jc.modes) == {"y" if policy == "all_y" else "kv"}
    assert torch.equal(hit, recorded)  # the cached rows are this very run's


@pytest.mark.parametrize("policy", ["planner", "all_kv"])
def test_other_mask_hit_is_close_to_full_computation(env, policy):
    family, pipe, rt = env
    img = template(seed=6)
    key = f"other-{policy}"
    cached(family, pipe, rt("planner"), make(family, pipe, img, np.zeros((SIZE, SIZE), np.uint8), key=key,
                                             register=True))
    mask = box_mask(box=(384, 128, 704, 576))
    j = make(family, pipe, img, mask, key=key, seed=9)
    hit = cached(family, pipe, rt(policy), j)
    assert j.cache.status == "hit" and int(j.cache.idx_c.numel()) < j.latents.shape[1]
    full = plain(family, pipe, make(family, pipe, img, mask, seed=9))
    m = torch.from_numpy(np.asarray(j.inputs.token_mask))
    assert torch.equal(hit[0, ~m], full[0, ~m])  # outside the mask both are the template (the pipeline's blend)
    a = np.asarray(family.decode(pipe, hit, SIZE, SIZE))
    b = np.asarray(family.decode(pipe, full, SIZE, SIZE))
    ssim = structural_similarity(a, b, channel_axis=2, data_range=255)
    err = float((hit[0, m] - full[0, m]).abs().mean())
    noctx = cached(family, pipe, rt("noctx"), make(family, pipe, img, mask, key=key, seed=9))
    err_noctx = float((noctx[0, m] - full[0, m]).abs().mean())
    other_seed = plain(family, pipe, make(family, pipe, img, mask, seed=10))
    seed_gap = float((other_seed[0, m] - full[0, m]).abs().mean())
    print(f"{policy}: ssim {ssim:.4f} mean|d| masked {err:.2e} (noctx {err_noctx:.2e}, another seed {seed_gap:.2e})")
    assert ssim >= 0.98
    assert err < 0.01 * seed_gap  # the cached context moves the edit by under 1% of what another seed does
    assert err < err_noctx  # the cached context is better than dropping it


def test_hit_and_uncached_request_share_a_call(env):
    """A kv hit and a request without the cache in one transformer call: each equals its result alone."""
    family, pipe, rt = env
    img, mask = template(seed=7), box_mask(box=(128, 128, 512, 640))
    key = "shared-call"
    runtime = rt("all_kv")
    cached(family, pipe, rt("planner"), make(family, pipe, img, np.zeros((SIZE, SIZE), np.uint8), key=key,
                                             register=True))
    alone = cached(family, pipe, runtime, make(family, pipe, img, mask, key=key, seed=3))
    other_img = template(seed=8)
    other_alone = plain(family, pipe, make(family, pipe, other_img, box_mask(), seed=4, prompt="a blue hat"))
    a, r = make(family, pipe, img, mask, key=key, seed=3), runner(family, pipe)
    other = make(family, pipe, other_img, box_mask(), seed=4, prompt="a blue hat")
    for j in (a, other):
        family.prepare_job(r, j)
        runtime.admit(j)
    assert a.cache.status == "hit" and other.cache.status == "off"
    assert family.group_key(a) == family.group_key(other)
    with torch.no_grad():
        while a.step_index < a.steps:
            family.step(r, [a, other], runtime.context([a, other]))
            runtime.after_step([a, other])
    for j in (a, other):
        runtime.finish(j, True)
    assert torch.equal(a.latents, alone) and torch.equal(other.latents, other_alone)


def test_guided_requests_run_uncached(env):
    """With classifier-free guidance the family refuses the cache (its entries hold the positive call's rows)."""
    family, pipe, _ = env
    img = template(seed=9)
    guided = make(family, pipe, img, box_mask(), guidance=4.0, negative_prompt="blurry", steps=2)
    plain_req = make(family, pipe, img, box_mask(), steps=2)
    assert not family.runs_cached(guided.inputs) and family.runs_cached(plain_req.inputs)
