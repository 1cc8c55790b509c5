"""Mask-aware caching on the flux_controlnet family: requests without controls through Flux's block hooks
(``maskedit.cache.flux``) driven by the unchanged ``CacheRuntime`` and a real store; a request with controls shares
a step with a cache hit (tiny model, float32, CPU)."""

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from maskedit.cache.runtime import CacheRuntime
from maskedit_lab.harness.baselines import cache_policy

from . import cn_util
from .cn_util import activation_store, box_mask, edges, edit, run, spec, template, tiny_model

STEPS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux-cn-cache")
    family, pipe, run_ = tiny_model(d / "tiny", seed=2)
    store = activation_store(d)
    runtimes = {}

    def rt(policy):
        if policy not in runtimes:
            runtimes[policy] = CacheRuntime(family.cache_hooks(pipe.transformer), store,
                                            policy=cache_policy(policy))
        return runtimes[policy]

    yield family, pipe, run_, rt
    for r in runtimes.values():
        r.close()


def make(env, img, mask, key=None, register=False, seed=0, specs=(), images=()):
    return edit(*env[:3], img, mask, specs, images, seed=seed, steps=STEPS, key=key, register=register)


def cached(env, runtime, jobs):
    family, _, run_, _ = env
    return cn_util.cached(family, run_, runtime, jobs)


def test_template_run_then_same_mask_hit_is_exact(env):
    family, pipe, run_, rt = env
    img, mask = template(seed=5), box_mask()
    first = make(env, img, mask, "same")
    (recorded,) = cached(env, rt("planner"), [first])
    assert first.cache.status == "record"
    assert torch.equal(recorded, run(family, run_, [make(env, img, mask)])[0])  # recording changes nothing
    again = make(env, img, mask, "same")
    (hit,) = cached(env, rt("all_y"), [again])
    assert again.cache.status == "hit" and int(again.cache.idx_c.numel()) == int(again.inputs.token_mask.sum())
    assert torch.equal(hit, recorded)


def test_other_mask_hit_is_close_to_full_computation(env):
    family, pipe, run_, rt = env
    img = template(seed=6)
    cached(env, rt("planner"), [make(env, img, np.zeros((256, 256), np.uint8), "other", register=True)])
    mask = box_mask(box=(96, 32, 176, 144))
    j = make(env, img, mask, "other", seed=9)
    (hit,) = cached(env, rt("planner"), [j])
    assert j.cache.status == "hit" and int(j.cache.idx_c.numel()) < j.latents.shape[1]
    (full,) = run(family, run_, [make(env, img, mask, seed=9)])
    m = torch.from_numpy(np.asarray(j.inputs.token_mask))
    assert torch.equal(hit[0, ~m], full[0, ~m])  # outside the mask both are the template (the blend)
    a, b = (np.asarray(family.decode(pipe, x, 256, 256)) for x in (hit, full))
    assert structural_similarity(a, b, channel_axis=2, data_range=255) >= 0.98
    assert float((hit[0, m] - full[0, m]).abs().mean()) < 1e-2  # seed to seed moves them by ~1


def test_a_hit_and_a_request_with_controls_share_a_step(env):
    """A kv hit (no controls) and a request with a ControlNet (uncached) in one step: each equals its result alone
    (the hit's row takes zero residuals)."""
    family, pipe, run_, rt = env
    img, mask = template(seed=7), box_mask(box=(32, 32, 128, 160))
    runtime = rt("all_kv")
    cached(env, rt("planner"), [make(env, img, np.zeros((256, 256), np.uint8), "mixed", register=True)])
    (alone,) = cached(env, runtime, [make(env, img, mask, "mixed", seed=3)])
    ctrl = [spec("canny", 0.8)], [edges(seed=1)]
    (other_alone,) = run(family, run_, [make(env, template(seed=8), box_mask(), seed=4, specs=ctrl[0],
                                             images=ctrl[1])])
    a, other = make(env, img, mask, "mixed", seed=3), make(env, template(seed=8), box_mask(), seed=4,
                                                          specs=ctrl[0], images=ctrl[1])
    hit, with_control = cached(env, runtime, [a, other])
    assert a.cache.status == "hit" and other.cache.status in ("off", "record")
    np.testing.assert_allclose(hit.numpy(), alone.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(with_control.numpy(), other_alone.numpy(), atol=1e-5, rtol=0)
