"""The flux_kontext family reproduces stock ``FluxKontextInpaintPipeline`` exactly (float32, CPU), batched or not,
with the template or a reference image as the in-context reference."""

import numpy as np
import pytest
import torch

from maskedit.families.flux_kontext import FluxKontextFamily
from maskedit.families.flux_kontext.tiny import build

from .kontext_util import box_mask, job, kparams, load, run, runner, stock, template

STEPS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build(tmp_path_factory.mktemp("kontext") / "tiny", "kontext-tiny", seed=0)
    return FluxKontextFamily(d), load(d)


def test_two_batched_requests_equal_the_stock_pipeline(model):
    """One request with the template as its reference, one with a reference image, in every transformer call
    together (a batch of one layout: the reference image has the template's size)."""
    family, pipe = model
    img, mask, ref = template(seed=1), box_mask(), template(seed=9)
    cases = [("make the hat red", 3, None), ("add a blue shirt", 7, ref)]
    jobs = [job(family, pipe, img, mask, kparams(prompt, seed=seed, steps=STEPS), reference=r)
            for prompt, seed, r in cases]
    out = run(family, runner(pipe), jobs)
    for latents, (prompt, seed, r) in zip(out, cases):
        assert torch.equal(latents, stock(pipe, img, mask, prompt, seed, STEPS, "latent", reference=r))
        ours = np.asarray(family.decode(pipe, latents, 256, 256))
        theirs = stock(pipe, img, mask, prompt, seed, STEPS, "pil", reference=r)[0]
        np.testing.assert_array_equal(ours, np.asarray(theirs))


def test_the_reference_image_matters_and_the_blend_keeps_the_template(model):
    family, pipe = model
    img, mask = template(seed=2), box_mask()
    a, b = (run(family, runner(pipe), [job(family, pipe, img, mask, kparams(seed=4, steps=2), reference=r)])[0]
            for r in (None, template(seed=11)))
    j = job(family, pipe, img, mask, kparams(seed=4, steps=2))
    run(family, runner(pipe), [j])
    keep = ~torch.from_numpy(np.asarray(j.inputs.token_mask))
    c = a.shape[-1]
    assert not torch.equal(a[0, ~keep], b[0, ~keep])  # the reference changes the edit
    assert torch.equal(a[0, keep], j.tensors.cond[0, keep, :c]) and torch.equal(b[0, keep], a[0, keep])


def test_another_size(model):
    family, pipe = model
    img, mask = template(320, 192, seed=3), box_mask(320, 192, (16, 100, 120, 260))
    (latents,) = run(family, runner(pipe), [job(family, pipe, img, mask, kparams(seed=11, steps=2))])
    assert torch.equal(latents, stock(pipe, img, mask, "make the hat red", 11, 2, "latent"))
