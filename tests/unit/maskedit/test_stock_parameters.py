"""The stock inpainting pipelines' own parameters (``strength``, ``padding_mask_crop``, ``guidance_rescale``,
``true_cfg_scale``) served in every family equal the stock pipeline's result for the same value, at the edges too
(strength 0.1 and 1.0, crop padding 0 and larger than the image), alone and batched with a request that does not set
them; bad values are refused naming their field, as the stock pipelines refuse them. docs/api.md has the table of
every parameter."""

import io
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from maskedit import samples
from maskedit.denoise import DenoiseJob
from maskedit.errors import InvalidInput
from maskedit.families import preset_family
from maskedit.local import LocalEditor, denoise_inputs
from maskedit.params import parse_params
from maskedit.settings import load_settings
from tests.conftest import exact_here, png

STEPS = 10  # strength 0.1 leaves one step in every family (SD 2 / SDXL truncate steps x strength)
FAMILIES = ("tiny", "sd2-tiny", "sdxl-tiny", "klein-tiny", "flux-cn-tiny", "kontext-tiny")
GUIDANCE = {"tiny": 12.0, "sd2-tiny": 7.5, "sdxl-tiny": 7.5, "klein-tiny": 1.0, "flux-cn-tiny": 3.5,
            "kontext-tiny": 2.5}
# The pipelines that blend the template back outside the mask every step: one cache entry serves every strength
BLENDS = ("klein-tiny", "flux-cn-tiny", "kontext-tiny")
# The pipelines that run at the image's own size: their templates are at the model's size here
OWN_SIZE = ("klein-tiny", "kontext-tiny")
# The pipelines with true classifier-free guidance (FluxInpaintPipeline for flux_controlnet without controls)
TRUE_CFG = ("flux-cn-tiny", "kontext-tiny")


@dataclass
class Served:
    preset: str
    settings: object
    editor: LocalEditor
    pipe: object  # the stock pipeline the family's results are checked against
    size: int  # the model's square resolution

    @property
    def flux(self) -> bool:
        return self.preset in ("tiny", "klein-tiny", "flux-cn-tiny", "kontext-tiny")


def stock_pipeline(s, family):
    """The family's stock pipeline from the same directory (Flux ControlNet inpainting without controls:
    ``FluxInpaintPipeline`` over the same components)."""
    pipe = family.pipeline_class().from_pretrained(s.model_dir, **family.pipeline_kwargs())
    if family.name == "flux_controlnet":
        from diffusers import FluxInpaintPipeline

        comps = {k: v for k, v in pipe.components.items() if k != "controlnet"}
        pipe = FluxInpaintPipeline(**comps, image_encoder=None, feature_extractor=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory, settings):
    over = {"MASKEDIT_DTYPE": settings.dtype, "MASKEDIT_DEVICE": settings.device, "MASKEDIT_FEATHER_PX": "0"}
    if request.param != "tiny":
        d = tmp_path_factory.mktemp(request.param) / "model"
        preset_family(request.param).build(d, request.param)
        over["MASKEDIT_MODEL_DIR"] = str(d)
    s = load_settings(over)  # no feathering: the stock pipelines paste the edit back with the mask as it is
    ed = LocalEditor(s, max_batch=2)
    yield Served(request.param, s, ed, stock_pipeline(s, ed.runner.family), s.resolution)
    ed.close()


def stock(sv: Served, tpl, mask, seed=5, steps=STEPS, **kw):
    """The stock pipeline's PIL image for the same inputs (the served model size is the template's)."""
    extra = {"max_sequence_length": sv.settings.max_sequence_length} if sv.flux else {}
    if sv.preset == "kontext-tiny":  # at the model's size, not one of Kontext's preferred resolutions
        extra.update(max_area=sv.size * sv.size, _auto_resize=False)
    return sv.pipe(prompt="a red hat", image=tpl, mask_image=Image.fromarray(mask), height=sv.size, width=sv.size,
                   num_inference_steps=steps, guidance_scale=GUIDANCE[sv.preset],
                   generator=torch.Generator("cpu").manual_seed(seed), **extra, **kw).images[0]


def ours(sv: Served, tpl, mask, seed=5, steps=STEPS, raw=True, **kw):
    out, p, job = sv.editor.edit(png(tpl), png(mask), "a red hat", seed=seed, template_seed=seed, steps=steps,
                                 guidance=GUIDANCE[sv.preset], raw_output=raw, use_cache=False, **kw)
    return np.asarray(Image.open(io.BytesIO(out)).convert("RGB")), p, job


def same(sv: Served, a: np.ndarray, b, grey: int = 0) -> None:
    """Our image against the stock one: equal on the CPU in float32 (``grey``: within that many grey levels, for a
    batch, whose GEMMs sum in another order), within a grey level on average elsewhere."""
    a, b = np.asarray(a, np.int16), np.asarray(b, np.int16)
    assert a.shape == b.shape
    diff = np.abs(a - b)
    if exact_here(sv.settings):
        assert diff.max() <= grey, (diff.max(), diff.mean())
    else:
        assert diff.mean() <= 1.0 and diff.max() <= 16


def scene(sv: Served, scale: int = 1, seed: int = 1):
    side = sv.size * scale
    mask = np.zeros((side, side), np.uint8)
    mask[side // 4:side // 2, side * 3 // 8:side * 3 // 4] = 255
    return samples.template(side, side, seed=seed), mask


# Steps run of STEPS: the Flux pipelines run int-truncated STEPS - STEPS x strength fewer, the UNet ones truncate
# STEPS x strength itself (SDXL's default 0.9999 runs 9 of 10)
RUN = {"flux": {0.1: 1, 0.45: 5, 0.9999: 10, 1.0: 10}, "unet": {0.1: 1, 0.45: 4, 0.9999: 9, 1.0: 10}}


@pytest.mark.parametrize("strength", [0.1, 0.45, 0.9999, 1.0])
def test_strength_equals_the_stock_pipeline(served, strength):
    tpl, mask = scene(served)
    img, p, job = ours(served, tpl, mask, strength=strength)
    same(served, img, stock(served, tpl, mask, strength=strength))
    assert job.run_steps == RUN["flux" if served.flux else "unet"][strength] == STEPS - p.first_step


def batched(sv: Served, tpl, mask, requests: list) -> list[np.ndarray]:
    """``requests`` ((parameters, seed) each) submitted together: the images as served (composited)."""
    ed = sv.editor
    jobs, done, prepared = [], [], []
    for kw, seed in requests:
        params = parse_params(sv.settings, "a red hat", seed=seed, template_seed=seed, steps=STEPS,
                              guidance=GUIDANCE[sv.preset], use_cache=False, **kw)
        prepared.append(ed.pre(png(tpl), png(mask), params))
        jobs.append(DenoiseJob(denoise_inputs(prepared[-1]), on_done=done.append))
    for j in jobs:
        ed.engine.submit(j)
    t0 = time.time()
    while len(done) < len(jobs) and time.time() - t0 < 300:
        time.sleep(0.02)
    assert len(done) == len(jobs) and ed.engine.max_running == len(jobs)  # every step held them all
    out = []
    for j, p in zip(jobs, prepared):
        img = ed.dec.decode_latents(j.result(), p.model_w, p.model_h)
        data = ed.dec.finish(img, p.template_rgb, p.alpha, False, False, crop=p.crop)
        out.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    return out


def test_a_strength_edit_batched_with_one_that_does_not_set_it(served):
    """Both in every step (each with its own schedule position), each equal to the stock pipeline alone."""
    tpl, mask = scene(served)
    requests = [(dict(strength=0.45), 3), ({}, 4)]
    for img, (kw, seed) in zip(batched(served, tpl, mask, requests), requests):
        # composited: the stock pipeline's output with the template outside the mask (no feathering here)
        # (the service's default strength is 1.0; SDXL's own default is 0.9999: say it)
        st = stock(served, tpl, mask, seed=seed, **{"strength": 1.0, **kw})
        ref = np.where(mask[..., None] > 0, np.asarray(st), np.asarray(tpl))
        same(served, img, ref, grey=1)


def test_strength_is_in_the_cache_key_unless_the_pipeline_blends_the_template_back(served):
    """docs/caching.md, "Strength": klein, Kontext and Flux ControlNet inpainting put the template back outside the mask
    every step, so one entry serves every strength; Flux Fill and SD 2 / SDXL key on the first step."""
    tpl, mask = scene(served)
    key = lambda strength: served.editor.pre(png(tpl), png(mask), parse_params(  # noqa: E731
        served.settings, "x", steps=STEPS, strength=strength)).cache_key
    assert (key(0.45) == key(1.0)) == (served.preset in BLENDS)
    assert key(1.0) == key(0.9999) or served.preset in ("sd2-tiny", "sdxl-tiny")  # 0.9999 runs 9 steps there


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_a_strength_outside_0_to_1_is_refused_naming_the_field(served, bad):
    with pytest.raises(InvalidInput) as e:
        parse_params(served.settings, "x", strength=bad)
    assert e.value.field == "STRENGTH" and "between 0.0 and 1.0" in str(e.value)


def test_a_strength_that_leaves_no_step_is_refused_as_the_stock_pipeline_refuses_it(served):
    tpl, mask = scene(served)
    with pytest.raises(ValueError, match="steps is 0"):
        stock(served, tpl, mask, strength=0.0)
    with pytest.raises(InvalidInput) as e:
        ours(served, tpl, mask, strength=0.0)
    assert e.value.field == "STRENGTH" and "no step" in str(e.value)
    assert served.editor.edit(png(tpl), png(mask), "x", steps=2)[2].done  # and it keeps serving


def stock_cropped(sv: Served, tpl, mask, pad: int, seed=5, **kw):
    """The stock pipeline with ``padding_mask_crop``. ``FluxFillPipeline`` has none: its inputs cropped and resized
    by the steps the other pipelines take (``get_crop_region``, the processors' "fill" resize) and its output pasted
    back by ``apply_overlay``, as theirs. ``FluxKontextInpaintPipeline`` returns the crop at the model's size: pasted
    back the same way."""
    pipe, m = sv.pipe, Image.fromarray(mask)
    crop = pipe.mask_processor.get_crop_region(m, sv.size, sv.size, pad=pad)
    if sv.preset == "kontext-tiny":
        out = stock(sv, tpl, mask, seed=seed, padding_mask_crop=pad, **{"strength": 1.0, **kw})
        return pipe.image_processor.apply_overlay(m, tpl, out, crop)
    if sv.preset != "tiny":
        return stock(sv, tpl, mask, seed=seed, padding_mask_crop=pad, **{"strength": 1.0, **kw})
    fit = dict(height=sv.size, width=sv.size, crops_coords=crop, resize_mode="fill")
    image, mask_t = pipe.image_processor.preprocess(tpl, **fit), pipe.mask_processor.preprocess(m, **fit)
    out = pipe(prompt="a red hat", image=image, mask_image=mask_t, height=sv.size, width=sv.size,
               num_inference_steps=STEPS, guidance_scale=GUIDANCE[sv.preset], strength=kw.get("strength", 1.0),
               max_sequence_length=sv.settings.max_sequence_length,
               generator=torch.Generator("cpu").manual_seed(seed)).images[0]
    return pipe.image_processor.apply_overlay(m, tpl, out, crop)


def crop_scene(sv: Served):
    """A template twice the model's size with a small mask (klein's and Kontext's pipelines run at the image's own
    size: at the model's there)."""
    return scene(sv, scale=1 if sv.preset in OWN_SIZE else 2, seed=3)


@pytest.mark.parametrize("pad", [0, 24, 100_000])
def test_padding_mask_crop_equals_the_stock_pipeline(served, pad):
    tpl, mask = crop_scene(served)
    img, p, _ = ours(served, tpl, mask, raw=False, padding_mask_crop=pad)
    same(served, img, stock_cropped(served, tpl, mask, pad))
    _, whole, _ = ours(served, tpl, mask, raw=False, steps=1)
    if pad < tpl.size[0]:  # the crop is the model's template: its tokens, more of them edited, another cache key
        assert (p.model_w, p.model_h) == (whole.model_w, whole.model_h) and p.crop is not None
        assert p.mask_ratio > 1.5 * whole.mask_ratio
    else:  # wider than the image: the whole template
        assert p.crop == (0, 0, tpl.size[0], tpl.size[1])


def test_a_cropped_edit_with_strength_batched_with_an_uncropped_one(served):
    tpl, mask = crop_scene(served)
    requests = [(dict(padding_mask_crop=16, strength=0.45), 3), ({}, 4)]
    cropped, whole = batched(served, tpl, mask, requests)
    same(served, cropped, stock_cropped(served, tpl, mask, 16, seed=3, strength=0.45), grey=1)
    ref = stock(served, tpl, mask, seed=4, strength=1.0) if served.preset in OWN_SIZE else None
    if ref is not None:  # at the model's size: the stock output composited
        same(served, whole, np.where(mask[..., None] > 0, np.asarray(ref), np.asarray(tpl)), grey=1)


def test_a_negative_crop_padding_is_refused_naming_the_field(served):
    with pytest.raises(InvalidInput) as e:
        parse_params(served.settings, "x", padding_mask_crop=-1)
    assert e.value.field == "PADDING_MASK_CROP"


def test_guidance_rescale_equals_sdxl_and_is_refused_where_the_pipeline_lacks_it(served):
    tpl, mask = scene(served)
    if served.preset == "sdxl-tiny":
        for rescale in (0.5, 1.0):
            img, _, _ = ours(served, tpl, mask, guidance_rescale=rescale)
            same(served, img, stock(served, tpl, mask, guidance_rescale=rescale, strength=1.0))
        assert not np.array_equal(img, ours(served, tpl, mask)[0])  # it does change the result
        return
    with pytest.raises(InvalidInput) as e:
        ours(served, tpl, mask, guidance_rescale=0.5)
    assert e.value.field == "GUIDANCE_RESCALE" and "not a parameter of" in str(e.value)


@pytest.mark.parametrize("fmt,magic", [("png", b"\x89PNG"), ("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
def test_output_format(served, fmt, magic):
    if served.preset != "tiny":
        pytest.skip("decoding is the same for every family")
    tpl, mask = scene(served)
    ed = served.editor
    png_out = ed.edit(png(tpl), png(mask), "a hat", steps=2)[0]
    out = ed.edit(png(tpl), png(mask), "a hat", steps=2, output_format=fmt.upper(), output_quality=90)[0]
    assert out.startswith(magic)
    a = np.asarray(Image.open(io.BytesIO(out)).convert("RGB"), np.int16)
    b = np.asarray(Image.open(io.BytesIO(png_out)).convert("RGB"), np.int16)
    assert np.abs(a - b).mean() < 8  # the same image, lossy at quality 90
    if fmt != "png":
        small = ed.edit(png(tpl), png(mask), "a hat", steps=2, output_format=fmt, output_quality=10)[0]
        assert len(small) < len(out)
    with pytest.raises(InvalidInput) as e:
        parse_params(served.settings, "x", output_format="gif")
    assert e.value.field == "OUTPUT_FORMAT" and "png, jpeg, webp" in str(e.value)


def test_true_cfg_scale_equals_flux_inpainting_and_is_refused_where_the_pipeline_lacks_it(served):
    tpl, mask = scene(served)
    neg = dict(true_cfg_scale=4.0, negative_prompt="blurry")
    if served.preset not in TRUE_CFG:
        with pytest.raises(InvalidInput) as e:
            ours(served, tpl, mask, true_cfg_scale=4.0)
        assert e.value.field == "TRUE_CFG_SCALE" and "not a parameter of" in str(e.value)
        return
    img, _, job = ours(served, tpl, mask, **neg)
    same(served, img, stock(served, tpl, mask, strength=1.0, **neg))
    assert job.cache is None or job.cache.status in ("off", "full")  # its negative row has no entries: in full
    assert not np.array_equal(img, ours(served, tpl, mask)[0])
    # batched with a request without it (each equal to the stock pipeline alone, within a grey level)
    requests = [(dict(neg, strength=0.45), 3), ({}, 4)]
    for out, (kw, seed) in zip(batched(served, tpl, mask, requests), requests):
        st = stock(served, tpl, mask, seed=seed, **{"strength": 1.0, **kw})
        same(served, out, np.where(mask[..., None] > 0, np.asarray(st), np.asarray(tpl)), grey=1)
    with pytest.raises(InvalidInput) as e:  # stock would ignore it (true_cfg_scale 1): refused, not dropped
        ours(served, tpl, mask, negative_prompt="blurry")
    assert e.value.field == "NEGATIVE_PROMPT" and "TRUE_CFG_SCALE" in str(e.value)
    if served.preset != "flux-cn-tiny":
        return
    from types import SimpleNamespace

    with pytest.raises(InvalidInput) as e:  # FluxControlNetInpaintPipeline has none
        served.editor.runner.family.check_options(SimpleNamespace(true_cfg_scale=4.0, controls=("edges",)))
    assert e.value.field == "TRUE_CFG_SCALE"



def test_kontext_crops_its_reference_image_and_guides_over_it_as_the_stock_pipeline(served):
    """FluxKontextInpaintPipeline crops ``image_reference`` with the template's ``padding_mask_crop`` box, and its
    true-CFG call sees the reference tokens too: both with a reference image equal the stock pipeline (a crop that
    left the reference uncropped fails the first)."""
    if served.preset != "kontext-tiny":
        pytest.skip("the reference image's crop is FluxKontextInpaintPipeline's")
    tpl, mask = crop_scene(served)
    ref = samples.template(served.size, served.size, seed=11)
    img, p, _ = ours(served, tpl, mask, raw=False, padding_mask_crop=8, reference_images=[png(ref)])
    same(served, img, stock_cropped(served, tpl, mask, 8, image_reference=ref))
    assert p.crop is not None and p.reference.shape[0] == p.latents.shape[0]
    neg = dict(true_cfg_scale=3.0, negative_prompt="blurry", strength=0.45)
    img, _, _ = ours(served, tpl, mask, reference_images=[png(ref)], **neg)
    same(served, img, stock(served, tpl, mask, image_reference=ref, **neg))

def test_a_controlnet_window_counts_the_steps_a_strength_edit_runs(served):
    """FluxControlNetInpaintPipeline's control_guidance_start / end are fractions of the steps it runs after
    strength (``len(timesteps)``): the same here, with a window that ends mid-way."""
    if served.preset != "flux-cn-tiny":
        pytest.skip("one ControlNet pipeline is enough: the window rule is shared (controlnets.job.run_position)")
    from diffusers import FluxControlNetInpaintPipeline, FluxControlNetModel

    tpl, mask = scene(served)
    edges = np.zeros((served.size, served.size, 3), np.uint8)
    edges[::37], edges[:, ::53] = 255, 255
    net = FluxControlNetModel.from_pretrained(served.editor.runner.family.model_dir / "controlnets" / "canny")
    control = [{"name": "canny", "scale": 0.8, "start": 0.0, "end": 0.5}]
    img, p, _ = ours(served, tpl, mask, strength=0.45, controls=control, control_images=[png(edges)])
    comps = {k: v for k, v in served.pipe.components.items() if k not in ("image_encoder", "feature_extractor")}
    pipe = FluxControlNetInpaintPipeline(**comps, controlnet=net)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt="a red hat", image=tpl, mask_image=Image.fromarray(mask), control_image=Image.fromarray(edges),
               height=served.size, width=served.size, strength=0.45, num_inference_steps=STEPS,
               guidance_scale=GUIDANCE[served.preset], controlnet_conditioning_scale=0.8, control_guidance_end=0.5,
               max_sequence_length=served.settings.max_sequence_length,
               generator=torch.Generator("cpu").manual_seed(5)).images[0]
    same(served, img, ref, grey=1)


def test_a_temporal_step_mask_counts_the_steps_a_strength_edit_runs(served):
    """TEMPORAL's step indices are the loop's (cache-dit's count), 0 at a STRENGTH edit's first step: a mask of all
    the steps it runs computes every one, equal to no reuse."""
    if served.preset != "tiny":
        pytest.skip("the step count is the engine's, not the family's")
    tpl, mask = scene(served)
    plain = ours(served, tpl, mask, strength=0.45)[0]
    every = {"policy": "steps", "steps": [0, 1, 2, 3, 4]}  # 5 of 10 steps run at 0.45
    img, _, job = ours(served, tpl, mask, strength=0.45, temporal=every)
    assert np.array_equal(img, plain) and "R" not in "".join(job.temporal.outcomes)
    with pytest.raises(InvalidInput) as e:  # step 5 is past the steps it runs
        ours(served, tpl, mask, strength=0.45, temporal={"policy": "steps", "steps": [0, 5]})
    assert e.value.field == "TEMPORAL"
