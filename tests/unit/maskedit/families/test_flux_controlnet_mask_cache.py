"""Mask-aware, cached ControlNets on the flux_controlnet family (``maskedit.cache.controlnet``): a template run with
controls records the ControlNet's rows beside the transformer's, a hit computes masked rows in both; keys cover the
controls (tiny model, float32, CPU)."""

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from maskedit.cache.key import cache_key, control_identity, dir_digest, image_digest
from maskedit.cache.runtime import CacheRuntime
from maskedit.families.flux_controlnet.tiny import build
from maskedit_lab.harness.baselines import cache_policy

from .cn_util import activation_store, admit, box_mask, denoise, edges, edit, finish, run, spec, template, tiny_model

STEPS = 3
EMPTY = np.zeros((256, 256), np.uint8)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux-cn-mask-cache")
    family, pipe, run_ = tiny_model(d / "tiny", seed=2)
    rt = CacheRuntime(family.cache_hooks(pipe.transformer), activation_store(d), policy=cache_policy("planner"))
    yield family, pipe, run_, rt
    rt.close()


def key(env, img, specs, images):
    """The request's key as the pre-processing stage makes it (``Preprocessor._control_identities``)."""
    family, pipe, run_, _ = env
    ids = [control_identity(s, dir_digest(run_.library.path(s.name)), image_digest(im)) for s, im in zip(specs, images)]
    return cache_key("fp", image_digest(img), 256, 256, STEPS, 3.5, 0, dict(pipe.scheduler.config), "float32",
                     controls=ids)


def make(env, img, mask, specs, images, seed=0, register=False):
    return edit(*env[:3], img, mask, specs, images, seed=seed, steps=STEPS, key=key(env, img, specs, images),
                register=register)


def cached(env, jobs):
    """``jobs`` denoised together through the runtime; returns (latents, per job its controls' cache states as
    admitted)."""
    family, _, run_, runtime = env
    states = []
    for j in jobs:  # each job's states read as it is admitted, before the next one
        admit(family, run_, runtime, [j])
        states.append([(p.cache.status, None if p.cache.idx_c is None else int(p.cache.idx_c.numel()))
                       for p in runtime.controls.rows(j)])
    denoise(family, run_, jobs, runtime)
    finish(runtime, jobs)
    return [j.latents for j in jobs], states


def test_template_run_with_controls_then_same_mask_hit_is_exact(env):
    family, pipe, run_, _ = env
    img, mask = template(seed=11), box_mask()
    ctrl = [spec("canny", 0.8)], [edges(seed=2)]
    (recorded,), ((st,),) = cached(env, [make(env, img, mask, *ctrl)])
    assert st[0] == "record"
    (plain,) = run(family, run_, [make(env, img, mask, *ctrl)])
    assert torch.equal(recorded, plain)  # recording changes nothing
    again = make(env, img, mask, *ctrl)
    (hit,), ((st,),) = cached(env, [again])
    n_masked = int(again.inputs.token_mask.sum())
    assert again.cache.status == "hit" and st == ("hit", n_masked) and n_masked < again.latents.shape[1]
    np.testing.assert_allclose(hit.numpy(), plain.numpy(), atol=1e-5, rtol=0)


def test_other_controls_miss_and_equal_their_own_run(env):
    family, pipe, run_, _ = env
    img, mask = template(seed=12), box_mask()
    ctrl = [spec("canny", 0.8)], [edges(seed=3)]
    cached(env, [make(env, img, EMPTY, *ctrl, register=True)])
    others = [([spec("canny", 0.5)], ctrl[1]), (ctrl[0], [edges(seed=4)]), ([spec("depth", 0.8)], ctrl[1]), ((), ())]
    keys = {key(env, img, *ctrl)} | {key(env, img, *o) for o in others}
    assert len(keys) == len(others) + 1  # scale, image, ControlNet, none: four other keys
    j = make(env, img, mask, *others[0])
    (got,), ((st,),) = cached(env, [j])
    assert j.cache.status == "record" and st[0] == "record"  # a miss: recorded under its own key
    (own,) = run(family, run_, [make(env, img, mask, *others[0])])
    assert torch.equal(got, own)


def test_other_mask_hit_with_controls_is_close_to_full_computation(env):
    family, pipe, run_, _ = env
    img = template(seed=13)
    ctrl = [spec("canny", 0.8)], [edges(seed=5)]
    cached(env, [make(env, img, EMPTY, *ctrl, register=True)])
    mask = box_mask(box=(96, 32, 176, 144))
    j = make(env, img, mask, *ctrl, seed=9)
    (hit,), ((st,),) = cached(env, [j])
    assert j.cache.status == "hit" and st[0] == "hit" and st[1] < j.latents.shape[1]
    (full,) = run(family, run_, [make(env, img, mask, *ctrl, seed=9)])
    m = torch.from_numpy(np.asarray(j.inputs.token_mask))
    assert torch.equal(hit[0, ~m], full[0, ~m])  # outside the mask both are the template (the blend)
    a, b = (np.asarray(family.decode(pipe, x, 256, 256)) for x in (hit, full))
    assert structural_similarity(a, b, channel_axis=2, data_range=255) >= 0.98


def test_through_the_engine_a_request_with_controls_records_then_hits(tmp_path):
    """Pre-processing keys the request by its controls, the runner no longer decides ``off`` for them."""
    from maskedit.cache.flux import FluxCacheHooks
    from maskedit.local import LocalEditor
    from maskedit.settings import load_settings
    from tests.conftest import png

    d = build(tmp_path / "flux-cn-tiny", "flux-cn-tiny", seed=1)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DEVICE": "cpu"})
    store = activation_store(tmp_path)
    ed = LocalEditor(s, cache=lambda t: CacheRuntime(FluxCacheHooks.of(t), store), store=store)
    try:
        img, mask, a = png(template(seed=14)), png(box_mask()), png(edges(seed=6))
        ask = lambda scale: ed.edit(img, mask, "a red hat", seed=3, steps=STEPS, raw_output=True,  # noqa: E731
                                    controls=[{"name": "canny", "scale": scale}], control_images=[a])
        _, p1, first = ask(0.8)
        ed.runner.cache.flush()
        _, p2, again = ask(0.8)
        _, p3, other = ask(0.6)
        assert first.cache.status == "record" and again.cache.status == "hit" and other.cache.status == "record"
        assert p1.cache_key == p2.cache_key != p3.cache_key
        np.testing.assert_allclose(again.result(), first.result(), atol=1e-5, rtol=0)
    finally:
        ed.close()


def test_a_controlnet_hit_and_an_uncached_request_share_its_call(env):
    """One ControlNet call over a hit's masked rows and another request's full rows: each equals its result alone."""
    family, pipe, run_, _ = env
    img, mask = template(seed=15), box_mask(box=(32, 32, 128, 160))
    ctrl = [spec("canny", 0.8)], [edges(seed=7)]
    cached(env, [make(env, img, EMPTY, *ctrl, register=True)])
    (alone,), _ = cached(env, [make(env, img, mask, *ctrl, seed=3)])
    other = lambda: make(env, template(seed=16), box_mask(), [spec("canny", 0.5)], [edges(seed=8)], seed=4)  # noqa
    (other_alone,) = run(family, run_, [other()])
    b = other()
    b.inputs.cache_key = None  # uncached
    (hit, with_control), (st, _) = cached(env, [make(env, img, mask, *ctrl, seed=3), b])
    assert st[0][0] == "hit"
    np.testing.assert_allclose(hit.numpy(), alone.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(with_control.numpy(), other_alone.numpy(), atol=1e-5, rtol=0)


def test_a_windowed_control_is_cached_and_its_hit_equals_the_uncached_run(env):
    """A control acting on part of the schedule (here step 1 of 3): its ControlNet's rows are recorded at the steps
    it acts (its entry holds those steps only) and a hit with the template's mask computes only the
    masked rows at those steps, equal to the uncached run. Another window is another key."""
    family, pipe, run_, runtime = env
    img, mask = template(seed=17), box_mask()
    ctrl = [spec("canny", 0.8, start=0.3, end=0.7)], [edges(seed=9)]
    assert key(env, img, *ctrl) != key(env, img, [spec("canny", 0.8, start=0.3)], ctrl[1])
    rec = make(env, img, mask, *ctrl)
    admit(family, run_, runtime, [rec])
    (p,) = runtime.controls.rows(rec)
    assert p.cache.status == "record"
    denoise(family, run_, [rec], runtime)
    y = p.cache.recorder.y  # its entry holds the one step it acts on, every slot written
    assert p.cache.recorder.complete and y.shape[0] == 1 and torch.count_nonzero(y[0]) > 0
    finish(runtime, [rec])
    (plain,) = run(family, run_, [make(env, img, mask, *ctrl)])
    assert torch.equal(rec.latents, plain)  # recording changes nothing
    again = make(env, img, mask, *ctrl)
    (hit,), ((st,),) = cached(env, [again])
    n_masked = int(again.inputs.token_mask.sum())
    assert again.cache.status == "hit" and st == ("hit", n_masked) and n_masked < again.latents.shape[1]
    np.testing.assert_allclose(hit.numpy(), plain.numpy(), atol=1e-5, rtol=0)
    unwindowed = make(env, img, mask, [spec("canny", 0.8)], ctrl[1])
    (other,) = run(family, run_, [unwindowed])
    assert np.abs(other.numpy() - plain.numpy()).max() > 1e-3  # negative control: the window matters


def test_a_request_and_its_controlnets_share_the_recording_budget(env, tmp_path):
    """The configured budget is split between the transformer and each cached control in proportion to their
    rows' bytes: a template run with two controls records no more than the budget in all."""
    from maskedit.cache.controlnet import split_budget

    assert split_budget(100, [2, 1, 1]) == [50, 25, 25] and split_budget(10, [1, 1, 1]) == [3, 3, 3]
    assert split_budget(100, [3, 0]) == [100, 0] and split_budget(5, [0, 0]) == [0, 0]
    family, pipe, run_, _ = env
    store = activation_store(tmp_path)
    hooks = family.cache_hooks(pipe.transformer)
    img = template(seed=18)
    ctrl = [spec("canny", 0.8), spec("depth", 0.5)], [edges(seed=10), edges(seed=11)]
    j = make(env, img, box_mask(), *ctrl)
    per_block = hooks.block_bytes(j.inputs, 4)[0]
    budget = 3 * per_block  # the transformer alone could record 3 blocks' outputs
    rt = CacheRuntime(hooks, store, policy=cache_policy("planner"), budget_bytes=budget)
    try:
        family.prepare_job(run_, j)
        rt.admit(j)
        recorders = [j.cache.recorder] + [p.cache.recorder for p in rt.controls.rows(j)]
        assert j.cache.status == "record" and all(r is not None for r in recorders)
        used = [r.nbytes for r in recorders]
        assert sum(used) <= budget and used[0] < budget  # before: each took up to the whole budget
        assert used == [len(r.y_slot) * per_block for r in recorders]  # y rows only at this budget
        rt.finish(j, False)
        wide = CacheRuntime(hooks, store, policy=cache_policy("planner"), budget_bytes=1 << 30)
        k = make(env, img, box_mask(), *ctrl, seed=1)
        family.prepare_job(run_, k)
        wide.admit(k)
        assert k.cache.recorder.nbytes > used[0]  # negative control: a large budget records more
        wide.finish(k, False)
        wide.close()
    finally:
        rt.close()
