"""Temporal reuse on FLUX.2 [klein] (``maskedit.temporal`` through the family's block hooks, whose single-stream
blocks take text and image as one sequence): no reuse equals the plain path bit for bit, a step mask skips the
middle blocks, a plain request and a reusing one in one call equal each alone, and a cache hit reuses on its
computed rows. (Diffusers' FirstBlockCache hook cannot run this model: its single-stream blocks return one joined
tensor, which the hook's tail residual does not expect; the Flux Fill tests hold the mechanism to the libraries.)"""

import pytest
import torch

from maskedit.families.flux2_klein import Flux2KleinFamily
from maskedit.families.flux2_klein.tiny import build

from .klein_util import box_mask, job, load, params, prepared, runner, template
from .temporal_util import (cached_with_reuse, check_a_hit_reuses, check_mixed_call_equals_each_alone,
                             check_no_reuse_is_plain, denoise_with_reuse)

STEPS = 6
MASK = {"policy": "steps", "steps": [0, 1, 3]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build(tmp_path_factory.mktemp("klein-temporal") / "tiny", "klein-tiny", seed=0)
    family, pipe = Flux2KleinFamily(d), load(d)
    prep, tokens = prepared(family, pipe, template(seed=1), box_mask(), params(seed=3, steps=STEPS))
    return family, pipe, prep, tokens


def run(model, policies):
    """One call per step for requests with ``policies`` (None: no reuse), as the runner drives them."""
    family, pipe, prep, tokens = model
    return denoise_with_reuse(family, runner(pipe), [job(prep, tokens, 256, 256, STEPS) for _ in policies],
                              policies)


def test_no_reuse_equals_the_plain_path_bit_for_bit(model):
    check_no_reuse_is_plain(lambda policies: run(model, policies), STEPS)


def test_a_plain_and_a_reusing_request_in_one_call_equal_each_alone(model):
    check_mixed_call_equals_each_alone(lambda policies: run(model, policies), MASK, "CCRCRR")


def test_a_cache_hit_reuses_on_its_computed_rows_and_equals_itself_batched(model, tmp_path):
    """A hit (its masked noisy tokens are what it computes and its residuals cover: the reference rows come from its
    entry) with a step mask, alone and beside a hit without reuse in one call; threshold 0 equals the hit without
    reuse bit for bit."""
    from maskedit.cache.runtime import CacheRuntime
    from maskedit.cache.store import ActivationStore

    family, pipe, prep, tokens = model
    rt = CacheRuntime(family.cache_hooks(pipe.transformer),
                      ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30))
    r = runner(pipe)

    def cached(policies, register=False):
        return cached_with_reuse(family, r, rt, [job(prep, tokens, 256, 256, STEPS) for _ in policies], policies,
                                 "klein-t", register)

    try:
        _, reused = check_a_hit_reuses(cached, MASK, "CCRCRR")
        assert int(reused.cache.idx_c.numel()) == int(reused.inputs.token_mask.sum())  # reference rows cached
    finally:
        rt.close()
