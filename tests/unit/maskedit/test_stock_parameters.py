"""The stock inpainting pipelines' own parameters (``strength``, ``padding_mask_crop``, ``guidance_rescale``) served
in every family equal the stock pipeline's result for the same value, at the edges too (strength 0.1 and 1.0, crop
padding 0 and larger than the image), alone and batched with a request that does not set them; bad values are
refused naming their field, as the stock pipelines refuse them. docs/api.md has the table of every parameter."""

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
FAMILIES = ("tiny", "sd2-tiny", "sdxl-tiny", "klein-tiny", "flux-cn-tiny")
GUIDANCE = {"tiny": 12.0, "sd2-tiny": 7.5, "sdxl-tiny": 7.5, "klein-tiny": 1.0, "flux-cn-tiny": 3.5}


@dataclass
class Served:
    preset: str
    settings: object
    editor: LocalEditor
    pipe: object  # the stock pipeline the family's results are checked against
    size: int  # the model's square resolution

    @property
    def flux(self) -> bool:
        return self.preset in ("tiny", "klein-tiny", "flux-cn-tiny")


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


def test_a_strength_edit_batched_with_one_that_does_not_set_it(served):
    """Both in every step (each with its own schedule position), each equal to the stock pipeline alone."""
    tpl, mask = scene(served)
    ed = served.editor
    requests = [(dict(strength=0.45), 3), ({}, 4)]
    jobs, done = [], []
    for kw, seed in requests:
        params = parse_params(served.settings, "a red hat", seed=seed, template_seed=seed, steps=STEPS,
                              guidance=GUIDANCE[served.preset], raw_output=True, use_cache=False, **kw)
        jobs.append(DenoiseJob(denoise_inputs(ed.pre(png(tpl), png(mask), params)), on_done=done.append))
    for j in jobs:
        ed.engine.submit(j)
    t0 = time.time()
    while len(done) < 2 and time.time() - t0 < 300:
        time.sleep(0.02)
    assert len(done) == 2 and ed.engine.max_running == 2
    for j, (kw, seed) in zip(jobs, requests):
        img = np.asarray(ed.dec.decode_latents(j.result(), served.size, served.size))
        same(served, img, stock(served, tpl, mask, seed=seed, strength=kw.get("strength", 1.0)), grey=1)


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
