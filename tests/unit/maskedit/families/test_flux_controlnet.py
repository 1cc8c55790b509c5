"""The flux_controlnet family reproduces stock ``FluxControlNetInpaintPipeline`` (float32, CPU) with one and two
ControlNets and a union ControlNet, a request without controls reproduces ``FluxInpaintPipeline`` (the same FLUX.1-dev
transformer and latent blending), and requests batched in one step (with and without controls, different
ControlNets) equal each alone."""

import numpy as np
import pytest
import torch
from diffusers import FluxControlNetInpaintPipeline, FluxControlNetModel, FluxInpaintPipeline, \
    FluxMultiControlNetModel
from PIL import Image

from maskedit.families import family_for

from .cn_util import GUIDANCE, MAX_SEQ, box_mask, edges, edit, run, spec, template, tiny_model

STEPS = 3
ATOL = 1e-5  # the parity tolerance of float32 on the CPU (test_local_parity)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("flux-cn") / "flux-cn-tiny", seed=0)


def net(family, name):
    return FluxControlNetModel.from_pretrained(family.model_dir / "controlnets" / name)


def stock(pipe, controlnet, img, mask, seed, control_image, **kw):
    """The stock ControlNet inpainting pipeline with ``controlnet`` swapped in (same components otherwise)."""
    p = FluxControlNetInpaintPipeline(**{**pipe.components, "controlnet": controlnet})
    p.set_progress_bar_config(disable=True)
    return p(prompt="a red hat", image=img, mask_image=Image.fromarray(mask), control_image=control_image,
             height=img.size[1], width=img.size[0], strength=1.0, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
             max_sequence_length=MAX_SEQ, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
             **kw).images


def close(a, b):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=ATOL, rtol=0)


def test_the_family_is_found_from_the_model_directory(model):
    family, pipe, _ = model
    assert family.name == "flux_controlnet" and pipe.transformer.config.in_channels == 16  # dev: latents only
    assert sorted(p.name for p in (family.model_dir / "controlnets").iterdir()) == ["canny", "depth", "union"]


def test_a_flux_1_dev_checkout_is_served_as_it_is(model, tmp_path):
    """A ``FluxPipeline`` directory (FLUX.1-dev's layout) is this family's, loads into the ControlNet inpainting
    pipeline and takes FLUX.1-dev's guidance by default."""
    from diffusers import FluxPipeline

    from maskedit.components import load_pipeline
    from maskedit.settings import load_settings

    family, pipe, _ = model
    comps = {k: v for k, v in pipe.components.items() if k != "controlnet"}
    FluxPipeline(**comps, image_encoder=None, feature_extractor=None).save_pretrained(tmp_path / "dev")
    s = load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path / "dev"), "MASKEDIT_DEVICE": "cpu"})
    assert family_for(tmp_path / "dev").name == "flux_controlnet" and s.guidance == 3.5
    loaded = load_pipeline(s, with_text=False)
    assert type(loaded).__name__ == "FluxControlNetInpaintPipeline" and loaded.mask_processor is not None


def test_one_controlnet_equals_the_stock_pipeline(model):
    family, pipe, run_ = model
    img, mask, ctrl = template(seed=1), box_mask(), edges(seed=2)
    j = edit(family, pipe, run_, img, mask, [spec("canny", 0.7)], [ctrl], seed=5, steps=STEPS)
    (ours,) = run(family, run_, [j])
    ref = stock(pipe, net(family, "canny"), img, mask, 5, ctrl, controlnet_conditioning_scale=0.7)
    close(ours, ref)
    # The ControlNet matters: without it the result is another one.
    plain = edit(family, pipe, run_, img, mask, seed=5, steps=STEPS)
    assert (run(family, run_, [plain])[0] - ours).abs().max() > 1e-2


def test_two_controlnets_with_scales_and_a_window_equal_the_stock_multi_controlnet(model):
    family, pipe, run_ = model
    img, mask, a, b = template(seed=3), box_mask(), edges(seed=4), edges(seed=5)
    specs = [spec("canny", 0.8), spec("depth", 1.3, start=0.3, end=0.7)]
    j = edit(family, pipe, run_, img, mask, specs, [a, b], seed=9, steps=STEPS)
    (ours,) = run(family, run_, [j])
    multi = FluxMultiControlNetModel([net(family, "canny"), net(family, "depth")])
    ref = stock(pipe, multi, img, mask, 9, [a, b], controlnet_conditioning_scale=[0.8, 1.3],
                control_guidance_start=[0.0, 0.3], control_guidance_end=[1.0, 0.7], control_mode=[None, None])
    close(ours, ref)


def test_a_union_controlnet_with_a_mode_equals_the_stock_pipeline(model):
    family, pipe, run_ = model
    img, mask, ctrl = template(seed=6), box_mask(box=(16, 16, 128, 240)), edges(seed=7)
    j = edit(family, pipe, run_, img, mask, [spec("union", 1.1, mode="depth")], [ctrl], seed=2, steps=STEPS)
    (ours,) = run(family, run_, [j])
    ref = stock(pipe, net(family, "union"), img, mask, 2, ctrl, controlnet_conditioning_scale=1.1, control_mode=2)
    close(ours, ref)


def test_two_controls_on_one_union_controlnet_equal_the_stock_multi_controlnet(model):
    """One union ControlNet with two control images and modes (stock: ``FluxMultiControlNetModel([union])``, which
    runs the one model per image): our step runs both in one batched call."""
    family, pipe, run_ = model
    img, mask, a, b = template(seed=12), box_mask(), edges(seed=13), edges(seed=14)
    specs = [spec("union", 0.6, mode="canny"), spec("union", 0.9, start=0.3, mode="depth")]
    (ours,) = run(family, run_, [edit(family, pipe, run_, img, mask, specs, [a, b], seed=6, steps=STEPS)])
    ref = stock(pipe, FluxMultiControlNetModel([net(family, "union")]), img, mask, 6, [a, b],
                controlnet_conditioning_scale=[0.6, 0.9], control_guidance_start=[0.0, 0.3],
                control_guidance_end=[1.0, 1.0], control_mode=[0, 2])
    close(ours, ref)


def test_a_request_without_controls_equals_stock_flux_inpainting(model):
    family, pipe, run_ = model
    img, mask = template(seed=8), box_mask()
    j = edit(family, pipe, run_, img, mask, seed=4, steps=STEPS)
    (ours,) = run(family, run_, [j])
    comps = {k: v for k, v in pipe.components.items() if k != "controlnet"}
    inpaint = FluxInpaintPipeline(**comps, image_encoder=None, feature_extractor=None)
    inpaint.set_progress_bar_config(disable=True)
    ref = inpaint(prompt="a red hat", image=img, mask_image=Image.fromarray(mask), height=256, width=256,
                  strength=1.0, num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQ,
                  generator=torch.Generator("cpu").manual_seed(4), output_type="latent").images
    close(ours, ref)
    # Blending: outside the mask the result is the template's clean latents exactly.
    c = ours.shape[-1]
    keep = ~torch.from_numpy(j.inputs.token_mask)
    assert torch.equal(ours[0, keep], j.tensors.cond[0, keep, :c])


def test_a_mixed_batch_equals_each_request_alone(model):
    family, pipe, run_ = model
    img, mask = template(seed=9), box_mask()
    a, b = edges(seed=10), edges(seed=11)
    requests = [((), (), 1), ([spec("canny", 0.9)], [a], 2),
                ([spec("depth", 0.6, end=0.5), spec("union", 1.0, mode="canny")], [b, a], 3),
                ([spec("union", 0.5, start=0.4, mode="tile")], [b], 4)]
    alone = [run(family, run_, [edit(family, pipe, run_, img, mask, s, c, seed=seed, steps=STEPS)])[0]
             for s, c, seed in requests]
    together = run(family, run_, [edit(family, pipe, run_, img, mask, s, c, seed=seed, steps=STEPS)
                                  for s, c, seed in requests])
    for x, y in zip(together, alone):
        close(x, y)


def test_control_residuals_of_one_job_are_the_controlnets_scaled_samples(model):
    """``control_residuals`` (the unit a separate ControlNet model would return): double then single samples of
    one ControlNet call, scaled."""
    family, pipe, run_ = model
    j = edit(family, pipe, run_, template(seed=2), box_mask(), [spec("union", 0.7, mode="pose")], [edges(seed=3)],
             seed=1, steps=STEPS)
    family.prepare_job(run_, j)
    active, mode, ctrl = j.tensors.controls[0]
    jt = j.tensors
    inputs = dict(hidden_states=j.latents, controlnet_cond=ctrl, controlnet_mode=mode,
                  timestep=j.scheduler.timesteps[:1] / 1000, guidance=jt.guidance, pooled_projections=jt.pooled,
                  encoder_hidden_states=jt.prompt_embeds, txt_ids=jt.txt_ids, img_ids=jt.img_ids)
    with torch.no_grad():
        flat = family.control_residuals(active, inputs, 0.7)
        double, single = active.model(hidden_states=j.latents, controlnet_cond=ctrl,
                                      controlnet_mode=torch.tensor([[4]]), conditioning_scale=0.7,
                                      timestep=inputs["timestep"], guidance=jt.guidance, pooled_projections=jt.pooled,
                                      encoder_hidden_states=jt.prompt_embeds, txt_ids=jt.txt_ids, img_ids=jt.img_ids,
                                      return_dict=False)
    assert mode == 4 and len(flat) == len(double) + len(single) == 2
    for a, b in zip(flat, [*double, *single]):
        assert torch.equal(a, b)
