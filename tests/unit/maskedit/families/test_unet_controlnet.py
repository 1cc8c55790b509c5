"""SDXL ControlNet inpainting in-process: served latents equal ``StableDiffusionXLControlNetInpaintPipeline`` with
one and two ControlNets (different scales, one with start / end), SD 2's ``StableDiffusionControlNetInpaintPipeline``
with two, the union ControlNet equals the stock loop with
the union pipeline's call, a mixed batch equals each request alone, and bad control input is refused naming its
field and control."""

import json
import shutil
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit import samples
from maskedit.controlnets import preprocessors
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.errors import InvalidInput
from maskedit.families import family_for
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit.local import LocalEditor, denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.settings import load_settings
from tests.conftest import atol, exact_here, png

STEPS = 3
SIZE = 128
PROMPT = "a red hat"


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory, settings):
    d = tmp_path_factory.mktemp("sdxl-cn") / "model"
    build_unet(d, "sdxl-tiny")
    family_for(d).build_controlnets(d / "controlnets", seed=0)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DTYPE": settings.dtype,
                       "MASKEDIT_DEVICE": settings.device})
    ed = LocalEditor(s, max_batch=3)
    yield s, ed
    ed.close()


def _images():
    tpl, mask = samples.template(SIZE, SIZE, seed=1), samples.mask(SIZE, SIZE, 0.25, "box", seed=1)
    # control images at other sizes than the template: resized to the model size as the pipelines do
    return tpl, mask, [samples.template(SIZE, SIZE, seed=7), samples.template(96, 160, seed=8)]


def _served(ed, controls, images, **kw):
    tpl, mask, _ = _images()
    _, p, job = ed.edit(png(tpl), png(mask), PROMPT, seed=5, steps=STEPS, guidance=7.5, raw_output=True,
                        template_seed=5, controls=controls, control_images=[png(i) for i in images], **kw)
    return p, job.result()


def _rows(latents):
    return latents.permute(1, 2, 0).reshape(-1, latents.shape[0]).float().cpu().numpy()


_BASE = {}


def _stock(s, controlnet, p, control_image, **kw):
    return _rows(_call_stock(s, controlnet, p, control_image, output_type="latent", **kw).images[0])


def _call_stock(s, controlnet, p, control_image, **kw):
    from diffusers import DiffusionPipeline, StableDiffusionXLControlNetInpaintPipeline

    tpl, mask, _ = _images()
    if str(s.model_dir) not in _BASE:  # one load of the stock components for every comparison
        _BASE[str(s.model_dir)] = DiffusionPipeline.from_pretrained(s.model_dir, dtype=torch.float32).components
    pipe = StableDiffusionXLControlNetInpaintPipeline(**_BASE[str(s.model_dir)], controlnet=controlnet)
    pipe.to(s.torch_device)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=PROMPT, image=tpl, mask_image=Image.fromarray(mask), control_image=control_image,
                height=p.model_h, width=p.model_w, num_inference_steps=STEPS, guidance_scale=7.5, strength=1.0,
                generator=torch.Generator().manual_seed(5), **kw)


def _assert_equal(s, got, ref):
    if exact_here(s):
        np.testing.assert_array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, atol=atol(s, 0))


def _net(s, name):
    from diffusers import ControlNetModel

    return ControlNetModel.from_pretrained(s.controlnets / name)


def test_one_and_two_controlnets_equal_the_stock_pipeline(sdxl):
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    s, ed = sdxl
    _, _, ctl = _images()
    p, one = _served(ed, [{"name": "canny", "scale": 0.8}], ctl[:1])
    _assert_equal(s, one, _stock(s, _net(s, "canny"), p, ctl[0], controlnet_conditioning_scale=0.8))
    two_spec = [{"name": "canny", "scale": 0.8}, {"name": "depth", "scale": 0.5, "start": 0.3, "end": 0.9}]
    p, two = _served(ed, two_spec, ctl)
    ref = _stock(s, MultiControlNetModel([_net(s, "canny"), _net(s, "depth")]), p, ctl,
                 controlnet_conditioning_scale=[0.8, 0.5], control_guidance_start=[0.0, 0.3],
                 control_guidance_end=[1.0, 0.9])
    _assert_equal(s, two, ref)
    _, plain = _served(ed, None, [])
    assert np.abs(one - plain).max() > 0.05 and np.abs(two - one).max() > 0.05  # each control really acts


def _stock_cropped(s, controlnet, p, control_image, pad, **kw):
    """``StableDiffusionXLControlNetInpaintPipeline`` with ``padding_mask_crop``: its final latents (its check
    refuses ``output_type="latent"`` with a crop, so they are taken at the last step's callback)."""
    seen = {}

    def keep(pipe, i, t, kwargs):
        seen["latents"] = kwargs["latents"]
        return {}
    _call_stock(s, controlnet, p, control_image, padding_mask_crop=pad, callback_on_step_end=keep,
                callback_on_step_end_tensor_inputs=["latents"], **kw)
    return _rows(seen["latents"][0])


def test_padding_mask_crop_with_one_and_two_controlnets_equals_the_stock_pipeline(sdxl, monkeypatch):
    """PADDING_MASK_CROP with ControlNets: as the template and the mask, each control image is cropped with the
    template's box (``crops_coords``, in pixels of the control image's own frame, whatever its size: the second is
    96 x 160) and resized "fill" to the model size, as the SDXL ControlNet inpaint pipeline's
    ``prepare_control_image`` does; the served latents equal the stock pipeline's. Stock refuses two ControlNets
    with a crop in ``check_inputs`` alone, whose rules contradict there (it checks the control image as ``image``:
    a PIL image with a crop, a list with a ``MultiControlNetModel``); the rest of its ``__call__`` crops each
    control image: for two, that check runs without the crop."""
    from diffusers import StableDiffusionXLControlNetInpaintPipeline as XL
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    check = XL.check_inputs  # called positionally, padding_mask_crop last
    monkeypatch.setattr(XL, "check_inputs", lambda self, *a: check(self, *a[:-1], None if isinstance(
        a[2], list) else a[-1]))
    s, ed = sdxl
    tpl, _, ctl = _images()
    p, one = _served(ed, [{"name": "canny", "scale": 0.8}], ctl[:1], padding_mask_crop=8)
    x1, y1, x2, y2 = p.crop
    assert x2 - x1 < tpl.size[0] and y2 - y1 < tpl.size[1]  # a crop smaller than the template: it matters
    _assert_equal(s, one, _stock_cropped(s, _net(s, "canny"), p, ctl[0], 8, controlnet_conditioning_scale=0.8))
    two_spec = [{"name": "canny", "scale": 0.8}, {"name": "depth", "scale": 0.5, "start": 0.3, "end": 0.9}]
    p, two = _served(ed, two_spec, ctl, padding_mask_crop=8)
    ref = _stock_cropped(s, MultiControlNetModel([_net(s, "canny"), _net(s, "depth")]), p, ctl, 8,
                         controlnet_conditioning_scale=[0.8, 0.5], control_guidance_start=[0.0, 0.3],
                         control_guidance_end=[1.0, 0.9])
    _assert_equal(s, two, ref)
    _, plain = _served(ed, None, [], padding_mask_crop=8)
    assert np.abs(one - plain).max() > 0.05 and np.abs(two - one).max() > 0.05  # each control acts on the crop


def test_sd2_two_controlnets_equal_the_stock_sd_pipeline(tmp_path_factory, settings):
    """SD 2 runs the same UNet path: two ControlNets against ``StableDiffusionControlNetInpaintPipeline``."""
    from diffusers import DiffusionPipeline, StableDiffusionControlNetInpaintPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    d = tmp_path_factory.mktemp("sd2-cn") / "model"
    build_unet(d, "sd2-tiny")
    assert [p.name for p in family_for(d).build_controlnets(d / "controlnets")] == ["canny", "depth"]  # no union
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DTYPE": settings.dtype,
                       "MASKEDIT_DEVICE": settings.device})
    tpl, mask, ctl = _images()
    spec = [{"name": "canny", "scale": 0.8}, {"name": "depth", "scale": 0.5, "start": 0.3, "end": 0.9}]
    ed = LocalEditor(s)
    try:
        _, p, job = ed.edit(png(tpl), png(mask), PROMPT, seed=5, steps=STEPS, guidance=7.5, raw_output=True,
                            template_seed=5, controls=spec, control_images=[png(c) for c in ctl])
    finally:
        ed.close()
    base = DiffusionPipeline.from_pretrained(d, safety_checker=None, requires_safety_checker=False)
    pipe = StableDiffusionControlNetInpaintPipeline(
        **base.components, controlnet=MultiControlNetModel([_net(s, "canny"), _net(s, "depth")])).to(s.torch_device)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt=PROMPT, image=tpl, mask_image=Image.fromarray(mask), control_image=ctl, height=p.model_h,
               width=p.model_w, num_inference_steps=STEPS, guidance_scale=7.5, strength=1.0,
               controlnet_conditioning_scale=[0.8, 0.5], control_guidance_start=[0.0, 0.3],
               control_guidance_end=[1.0, 0.9], generator=torch.Generator().manual_seed(5),
               output_type="latent").images[0]
    _assert_equal(s, job.result(), _rows(ref))


def test_union_controlnet_equals_the_stock_loop_with_the_union_pipelines_call(sdxl):
    """``StableDiffusionXLControlNetUnionInpaintPipeline`` runs only 4-channel UNets (latent blending), so the
    9-channel inpainting UNet we serve cannot run in it. The reference is the stock ControlNet inpaint pipeline's
    loop whose ControlNet call is the union model called as the union pipeline calls it (its one-hot
    ``control_type`` per row, the image in its mode's slot)."""
    from diffusers import ControlNetUnionModel

    s, ed = sdxl
    _, _, ctl = _images()
    p, got = _served(ed, [{"name": "union", "scale": 0.9, "mode": "depth", "end": 0.7}], ctl[:1])
    union = ControlNetUnionModel.from_pretrained(s.controlnets / "union")
    carrier = _net(s, "canny")  # a ControlNetModel for the pipeline's type checks; its call goes to the union
    mode = 1

    def union_call(sample, t, encoder_hidden_states, controlnet_cond, conditioning_scale, guess_mode,
                   added_cond_kwargs, return_dict):
        n = union.config.num_control_type
        control_type = torch.zeros(n).scatter_(0, torch.tensor([mode]), 1).reshape(1, -1).repeat(sample.shape[0], 1)
        return union(sample, t, encoder_hidden_states=encoder_hidden_states, controlnet_cond=[controlnet_cond],
                     control_type=control_type, control_type_idx=[mode], conditioning_scale=conditioning_scale,
                     guess_mode=guess_mode, added_cond_kwargs=added_cond_kwargs, return_dict=return_dict)

    carrier.forward = union_call
    ref = _stock(s, carrier, p, ctl[0], controlnet_conditioning_scale=0.9, control_guidance_end=0.7)
    _assert_equal(s, got, ref)
    _, other_mode = _served(ed, [{"name": "union", "scale": 0.9, "mode": "canny", "end": 0.7}], ctl[:1])
    assert np.abs(other_mode - got).max() > 1e-3  # the mode matters


def test_a_mixed_batch_equals_each_request_alone(sdxl):
    """One UNet call per step for a request without controls, one with a ControlNet and one with two others (one
    union); each equals its run alone."""
    s, ed = sdxl
    tpl, mask, ctl = _images()
    specs = [None, [{"name": "canny", "scale": 1.2}],
             [{"name": "depth", "scale": 0.6, "start": 0.4}, {"name": "union", "scale": 0.7, "mode": "pose"}]]
    inputs = []
    for i, spec in enumerate(specs):
        params = parse_params(s, PROMPT, seed=10 + i, steps=STEPS, guidance=7.5,
                              controls=json.dumps(spec) if spec else None)
        n = len(spec or ())
        inputs.append(denoise_inputs(ed.pre(png(tpl), png(mask), params, [png(c) for c in ctl[:n]])))
    alone = [run_job(ed.engine, x).result() for x in inputs]
    runner = ModelRunner(s, transformer=ed.runner.transformer)
    eng = DenoiseEngine(runner, max_batch=3)
    try:
        done, finished = [], threading.Event()
        jobs = [DenoiseJob(x, on_done=lambda j: (done.append(j), len(done) == 3 and finished.set())) for x in inputs]
        for j in jobs:
            eng.submit(j)
        assert finished.wait(120) and eng.max_running == 3
        for j, ref in zip(jobs, alone):  # batched convolutions round differently: latents up to ~7 agree to 1e-4
            np.testing.assert_allclose(j.result(), ref, atol=atol(s, 1e-4))
        assert jobs[0].control_s == 0 and jobs[1].control_s > 0 and jobs[2].control_s > 0
    finally:
        eng.shutdown()


def test_scale_zero_equals_no_control(sdxl):
    s, ed = sdxl
    _, _, ctl = _images()
    _, zero = _served(ed, [{"name": "canny", "scale": 0}], ctl[:1])
    _, plain = _served(ed, None, [])
    np.testing.assert_array_equal(zero, plain)


@pytest.fixture(scope="module")
def library(sdxl):
    """The library plus what a caller must not get served: another family's ControlNet (by its class) and one of
    another width (an SD 2-sized text width: the weights load, the check refuses it)."""
    from diffusers import ControlNetModel

    s, ed = sdxl
    (s.controlnets / "flux-edges").mkdir(exist_ok=True)
    (s.controlnets / "flux-edges" / "config.json").write_text(json.dumps({"_class_name": "FluxControlNetModel"}))
    cfg = dict(ControlNetModel.load_config(s.controlnets / "canny"))
    cfg.update(cross_attention_dim=32, addition_embed_type=None, projection_class_embeddings_input_dim=None)
    ControlNetModel.from_config(cfg).save_pretrained(s.controlnets / "sd2-edges")
    yield s, ed
    shutil.rmtree(s.controlnets / "flux-edges")
    shutil.rmtree(s.controlnets / "sd2-edges")


def _bad(ed, s, controls, images):
    tpl, mask, _ = _images()
    with pytest.raises(InvalidInput) as e:
        params = parse_params(s, PROMPT, steps=STEPS, controls=json.dumps(controls))
        p = ed.pre(png(tpl), png(mask), params, images)
        job = DenoiseJob(denoise_inputs(p))
        ed.runner.load_controls(job)
    return e.value


def _png_of(w, h):
    return png(np.zeros((h, w, 3), np.uint8))


def _huge_png(w, h):
    """A small PNG whose header says ``w`` x ``h`` (its IHDR rewritten, CRC fixed)."""
    import struct
    import zlib

    data = bytearray(_png_of(16, 16))
    ihdr = data[12:29]  # b"IHDR" + 13 bytes
    ihdr[4:12] = struct.pack(">II", w, h)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


@pytest.mark.parametrize("controls, images, field, words", [
    ([{"name": "nope"}], 1, "CONTROLS", "control 0: unknown ControlNet 'nope'; available: canny, depth"),
    ([{"name": "canny"}, {"name": "flux-edges"}], 2, "CONTROLS", "control 1: ControlNet 'flux-edges' is a "
     "FluxControlNetModel, for another model family"),
    ([{"name": "sd2-edges"}], 1, "CONTROLS", "control 0: ControlNet 'sd2-edges' has cross_attention_dim 32"),
    ([{"name": "canny", "mode": "depth"}], 1, "CONTROLS", "takes no \"mode\""),
    ([{"name": "union"}], 1, "CONTROLS", "is a union ControlNet; give its \"mode\""),
    ([{"name": "canny"}], [b"not an image"], "CONTROL_IMAGES", "control 0: could not decode image"),
    ([{"name": "canny"}], [b""], "CONTROL_IMAGES", "control 0: is empty"),
    ([{"name": "canny"}, {"name": "depth"}], ["ok", (1, 1)], "CONTROL_IMAGES", "control 1: image is 1x1"),
    ([{"name": "canny"}], [(20000, 20000)], "CONTROL_IMAGES", "above the limit"),
    ([{"name": "canny"}, {"name": "depth"}], 1, "CONTROL_IMAGES", "control 1: has no image for ControlNet 'depth'"),
    ([{"name": "canny"}], 2, "CONTROLS", "control 1: names no ControlNet for this image"),
    ([{"name": "canny", "scale": 9}], 1, "CONTROLS", "control 0: scale must be between 0 and 4.0"),
    ([{"name": "canny", "start": 0.8, "end": 0.2}], 1, "CONTROLS", "must be below end"),
    ([{"name": "a"}, {"name": "b"}, {"name": "c"}], 3, "CONTROLS", "3 controls, above the limit of 2"),
])
def test_bad_control_input_names_the_field_and_the_control(library, controls, images, field, words):
    s, ed = library
    ok = _png_of(64, 64)
    if isinstance(images, int):
        images = [ok] * images
    elif (20000, 20000) in images:  # a header claiming 20000 x 20000: refused before decoding
        images = [_huge_png(20000, 20000)]
    else:
        images = [ok if i == "ok" else _png_of(*i) if isinstance(i, tuple) else i for i in images]
    err = _bad(ed, s, controls, images)
    assert err.field == field and words in str(err), str(err)
    assert "<" not in str(err)  # no object reprs


def test_canny_preprocessor_turns_a_photo_into_an_edge_map(sdxl):
    s, ed = sdxl
    tpl, mask, ctl = _images()
    params = parse_params(s, PROMPT, steps=STEPS, controls=json.dumps([{"name": "canny", "preprocess": "canny"}]))
    p = ed.pre(png(tpl), png(mask), params, [png(ctl[0])])
    edges = preprocessors.canny(ctl[0])
    assert set(np.unique(np.asarray(edges))) == {0, 255}  # a white-on-black edge map
    ref = ed.pre.family.prepare_control_image(ed.pre.pipe, edges, p.model_w, p.model_h, s)
    np.testing.assert_array_equal(p.controls[0].image, ref.numpy())
    assert 0 < ref.mean() < 0.5
