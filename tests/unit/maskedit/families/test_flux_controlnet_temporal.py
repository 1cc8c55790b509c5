"""Temporal reuse with ControlNets (``flux_controlnet``): a reused step's middle residual carries the ControlNet
residuals its middle blocks received on the last computed step, and the first blocks take this step's (the
transformer adds them after every block; a reused row's middle blocks pass through and the last one is set to its
input plus the residual). No reuse equals the plain path bit for bit; requests with and without controls and
reuse in one call equal each alone."""

import pytest
import torch

from .cn_util import box_mask, edges, edit, spec, template, tiny_model
from .temporal_util import denoise_with_reuse

STEPS = 5
MASK = {"policy": "steps", "steps": [0, 1, 3]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("flux-cn-temporal") / "flux-cn-tiny", seed=0)


def run(model, requests):
    """``requests``: (controls, control images, seed, policy) each, stepped together as one group."""
    family, pipe, run_ = model
    jobs = [edit(family, pipe, run_, template(seed=9), box_mask(), specs, images, seed=seed, steps=STEPS)
            for specs, images, seed, _ in requests]
    return denoise_with_reuse(family, run_, jobs, [r[3] for r in requests])


def test_no_reuse_with_controls_equals_the_plain_path_bit_for_bit(model):
    c = ([spec("canny", 0.8)], [edges(seed=10)], 2)
    (plain,) = run(model, [c + (None,)])
    (zero,) = run(model, [c + ({"policy": "fbcache", "threshold": 0},)])
    assert torch.equal(zero.latents, plain.latents)


def test_mixed_calls_with_controls_and_reuse_equal_each_alone(model):
    requests = [((), (), 1, MASK), ([spec("canny", 0.8)], [edges(seed=10)], 2, MASK),
                ([spec("depth", 0.6, end=0.6)], [edges(seed=11)], 3, None)]
    alone = [run(model, [r])[0] for r in requests]
    assert alone[1].temporal.info()["temporal_steps"] == "CCRCR"
    together = run(model, requests)
    for x, y in zip(together, alone):
        torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=0)
