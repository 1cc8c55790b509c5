"""A template run that was an edit leaves its masked tokens invalid in the entry; a later hit that leaves them
unmasked computes them as template context and heals the entry, so the hits after it compute only their own
masked tokens."""

import numpy as np
import pytest
import torch

from maskedit import samples
from maskedit.families.flux_fill.cache import FluxCacheHooks
from maskedit.cache.policy import needs_output
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.local import denoise_inputs
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit_lab.harness.baselines import FixedPolicy
from tests.conftest import atol, png

STEPS = 3
SIZE = 256


def box(x0: int, x1: int) -> np.ndarray:
    """Columns x0..x1 (pixels, on token boundaries) edited, full height."""
    m = np.zeros((SIZE, SIZE), np.uint8)
    m[:, x0:x1] = 255
    return m


LEFT, RIGHT, MIDDLE = box(0, 64), box(192, 256), box(48, 112)  # LEFT and MIDDLE share one token column


@pytest.fixture()
def env(settings, tmp_path):
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(settings, store=store)
    base = ModelRunner(settings)
    tpl = samples.template(SIZE, SIZE, seed=41)
    runtimes = []

    def runner(**kw):
        rt = CacheRuntime(FluxCacheHooks.of(base.transformer), store, **kw)
        runtimes.append(rt)
        return ModelRunner(settings, transformer=base.transformer, cache=rt), rt

    def inputs(mask, register=False):
        params = parse_params(settings, "a scarf", steps=STEPS, register=register)
        return denoise_inputs(pre(png(tpl), png(mask), params))

    yield runner, store, inputs
    for rt in runtimes:
        rt.close()


def run(runner, x, capture_blocks=None):
    """Denoise ``x`` alone; with ``capture_blocks``, also return every block's image output at step 0."""
    job = DenoiseJob(x)
    runner.prepare(job)
    seen, handles = {}, []

    def keep(b):
        def hook(mod, args, out):
            seen[b] = out[1][0].detach().clone()  # returns None: the output is unchanged
        return hook
    for b, block in enumerate(capture_blocks or []):
        handles.append(block.register_forward_hook(keep(b)))
    try:
        while not job.done:
            runner.step([job])
            for h in handles:
                h.remove()
            handles = []
    finally:
        for h in handles:
            h.remove()
    runner.release(job, ok=True)
    return job, seen


def tokens(x):
    return np.flatnonzero(np.asarray(x.token_mask, bool))


def test_a_hit_heals_the_tokens_the_template_run_edited(env):
    runner_, store, inputs = env
    runner, rt = runner_()
    left, right = inputs(LEFT), inputs(RIGHT)
    run(runner, left)  # template run: LEFT's tokens hold its edit
    rt.flush()
    before = store.open(left.cache_key)
    assert before.meta["valid_tokens"] == left.latents.shape[0] - tokens(left).size

    blocks = FluxCacheHooks.of(runner.transformer).blocks
    hit, step0 = run(runner, right, capture_blocks=blocks)
    jc = hit.cache
    assert jc.status == "hit" and jc.idx_c.numel() == tokens(left).size + tokens(right).size
    assert jc.info()["healed_tokens"] == tokens(left).size
    rt.flush()
    assert store.stats.heals == 1
    healed = store.open(left.cache_key)
    assert healed is not before and healed.meta["valid_tokens"] == left.latents.shape[0]
    assert np.asarray(healed.arrays["valid"]).all()
    # Tokens outside LEFT keep the template run's rows to the bit; LEFT's rows are what the hit computed.
    keep = np.setdiff1d(np.arange(left.latents.shape[0]), tokens(left))
    for name in ("y", "k", "v"):
        np.testing.assert_array_equal(healed.arrays[name][:, :, keep], before.arrays[name][:, :, keep])
    for slot, b in enumerate(healed.meta["y_blocks"]):
        assert torch.equal(healed.tensor("y")[0, slot, tokens(left)], step0[b][tokens(left)].cpu())

    # The same request again computes only its own tokens and gives the same result: the healed rows are the
    # ones it computed itself the first time.
    again, _ = run(runner, right)
    assert again.cache.idx_c.numel() == tokens(right).size
    np.testing.assert_allclose(again.result(), hit.result(), atol=atol(runner.settings, 1e-5))


def test_an_overlapping_hit_heals_all_but_its_own_tokens_and_small_heals_are_skipped(env):
    runner_, store, inputs = env
    runner, rt = runner_()
    left, middle = inputs(LEFT), inputs(MIDDLE)
    run(runner, left)
    rt.flush()
    run(runner, middle)
    rt.flush()
    valid = np.asarray(store.open(left.cache_key).arrays["valid"], bool)
    shared = np.intersect1d(tokens(left), tokens(middle))
    assert shared.size and not valid[shared].any() and valid.sum() == valid.size - shared.size
    # What is left to heal (one token column, 1/16 of the tokens) is under a threshold of 10 %: no rewrite.
    runner2, rt2 = runner_(heal_min_ratio=0.1)
    job, _ = run(runner2, inputs(RIGHT))
    rt2.flush()
    assert job.cache.patch is None and store.stats.heals == 1


def test_a_hit_that_computes_a_block_in_full_does_not_heal(env):
    runner_, store, inputs = env
    runner, rt = runner_(policy=FixedPolicy("all_y"))
    left = inputs(LEFT)
    run(runner, left)
    rt.flush()
    right = inputs(RIGHT)
    job = DenoiseJob(right)
    runner.prepare(job)
    jc = job.cache
    jc.modes[0] = "full"  # as the planner may choose
    jc.needs_output = needs_output(jc.modes)
    while not job.done:
        runner.step([job])
    runner.release(job, ok=True)
    rt.flush()
    assert not jc.patch.complete and store.stats.heals == 0
    assert not np.asarray(store.open(left.cache_key).arrays["valid"], bool)[tokens(left)].any()
    # and the key is free for a later heal
    job2, _ = run(runner, right)
    rt.flush()
    assert store.stats.heals == 1 and np.isfinite(job2.result()).all()
