"""The flux2_klein family reproduces stock ``Flux2KleinInpaintPipeline`` exactly (float32, CPU), batched or not."""

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit.families.flux2_klein import Flux2KleinFamily
from maskedit.families.flux2_klein import prepare as P
from maskedit.families.flux2_klein.tiny import build

from .klein_util import box_mask, job, load, params, prepared, run, runner, stock, template

STEPS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build(tmp_path_factory.mktemp("klein") / "tiny", "klein-tiny", seed=0)
    return Flux2KleinFamily(d), load(d)


def test_two_batched_requests_equal_the_stock_pipeline(model):
    family, pipe = model
    img, mask = template(seed=1), box_mask()
    jobs, refs = [], []
    for seed, prompt in ((3, "a red hat"), (7, "a blue shirt")):
        prep, tokens = prepared(family, pipe, img, mask, params(prompt, seed=seed, steps=STEPS))
        jobs.append(job(prep, tokens, 256, 256, STEPS))
        refs.append(seed)
    out = run(family, runner(pipe), jobs)  # both requests in every transformer call
    for latents, seed, prompt in zip(out, refs, ("a red hat", "a blue shirt")):
        ref = stock(pipe, img, mask, prompt, seed, STEPS, "latent")
        assert torch.equal(P.vae_latents(pipe, latents, 256, 256), ref)
        ours = np.asarray(family.decode(pipe, latents, 256, 256))
        theirs = stock(pipe, img, mask, prompt, seed, STEPS, "pil")[0]
        np.testing.assert_array_equal(ours, np.asarray(theirs))


def test_one_request_equals_stock_at_another_size(model):
    family, pipe = model
    img, mask = template(320, 192, seed=2), box_mask(320, 192, (16, 100, 120, 260))
    prep, tokens = prepared(family, pipe, img, mask, params(seed=11, steps=2))
    (latents,) = run(family, runner(pipe), [job(prep, tokens, 320, 192, 2)])
    assert torch.equal(P.vae_latents(pipe, latents, 320, 192), stock(pipe, img, mask, "a red hat", 11, 2, "latent"))


def test_tensor_slots_and_seed_varies_only_the_masked_noise(model):
    family, pipe = model
    img, mask = template(seed=3), box_mask()
    a, tokens = prepared(family, pipe, img, mask, params(seed=1, template_seed=0))
    b, _ = prepared(family, pipe, img, mask, params(seed=2, template_seed=0))
    c = pipe.latent_channels * 4
    n = (256 // 16) ** 2
    assert a.latents.shape == (n, c) and a.cond.shape == (n, 2 * c + 1) and a.pooled_embeds.shape == (1,)
    assert a.prompt_embeds.shape == (64, pipe.transformer.config.joint_attention_dim)
    m = torch.from_numpy(tokens)
    assert torch.equal(a.latents[~m], b.latents[~m]) and not torch.equal(a.latents[m], b.latents[m])
    ref_a, noise_a, blend = P.split_cond(a.cond, c)
    ref_b, noise_b, _ = P.split_cond(b.cond, c)
    assert torch.equal(ref_a, ref_b) and torch.equal(noise_a[~m], noise_b[~m])
    assert torch.equal(a.latents, noise_a)  # strength 1.0: the first sigma is 1, latents are the noise
    assert float(blend[~m].abs().max()) == 0.0 and float(blend[m].max()) == 1.0  # blend > 0 only where masked


def test_base_model_guidance_is_refused(model):
    from maskedit.errors import InvalidInput

    family, pipe = model
    pipe.register_to_config(is_distilled=False)
    try:
        with pytest.raises(InvalidInput):
            prepared(family, pipe, template(), box_mask(), params(guidance=4.0))
    finally:
        pipe.register_to_config(is_distilled=True)


def _with_references(family, pipe, img, mask, p, refs):
    from .klein_util import settings

    prep, tokens = prepared(family, pipe, img, mask, p)
    j = job(prep, tokens, img.size[0], img.size[1], p.steps)
    rows, grids = family.prepare_references(pipe, refs, img.size[0], img.size[1], settings())
    j.inputs.reference, j.inputs.reference_grids = rows.numpy(), grids
    return j


@pytest.mark.parametrize("n_refs", [1, 2])
def test_reference_images_equal_the_stock_pipeline_batched(model, n_refs):
    """Requests with reference images (the stock pipeline's ``image_reference`` list, after the template's own
    latents: position times 20, 30, ...) batched in every call, each equal to the stock pipeline's result."""
    family, pipe = model
    img, mask = template(seed=1), box_mask()
    refs = [template(seed=20 + k) for k in range(n_refs)]
    cases = ((3, "a red hat"), (7, "a blue shirt"))
    jobs = [_with_references(family, pipe, img, mask, params(prompt, seed=seed, steps=STEPS), refs)
            for seed, prompt in cases]
    out = run(family, runner(pipe), jobs)
    assert jobs[0].tensors.img_ids.shape[0] == (2 + n_refs) * 256
    for latents, (seed, prompt) in zip(out, cases):
        ref = pipe(prompt=prompt, image=img, image_reference=refs, mask_image=Image.fromarray(mask),
                   num_inference_steps=STEPS, strength=1.0, guidance_scale=1.0, max_sequence_length=64,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").images
        assert torch.equal(P.vae_latents(pipe, latents, 256, 256), ref)
