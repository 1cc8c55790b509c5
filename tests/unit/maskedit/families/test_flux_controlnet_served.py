"""The flux_controlnet family through the serving stages in one process (``LocalEditor``: pre-processing, the
controls' wire format, the engine's runner and step loop, decoding): equal to stock ``FluxControlNetInpaintPipeline``
with two ControlNets; requests batched by the engine equal each alone; bad controls fail their request only, naming
the field."""

import io
import json

import numpy as np
import pytest
import torch
from diffusers import FluxControlNetInpaintPipeline, FluxControlNetModel, FluxMultiControlNetModel
from PIL import Image

from maskedit.errors import InvalidInput
from maskedit.families.flux_controlnet.tiny import build
from maskedit.local import LocalEditor, run_job
from maskedit.settings import load_settings
from tests.conftest import png

from .cn_util import MAX_SEQ, box_mask, concurrently, edges, engine_inputs, template

STEPS = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = build(tmp_path_factory.mktemp("flux-cn-served") / "flux-cn-tiny", "flux-cn-tiny", seed=1)
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DEVICE": "cpu", "MASKEDIT_CACHE": "off"})
    ed = LocalEditor(s, max_batch=4)
    yield ed, d
    ed.close()


def test_two_controlnets_served_equal_the_stock_pipeline(served):
    ed, d = served
    img, mask, a, b = template(seed=1), box_mask(), edges(seed=2), edges(seed=3)
    controls = [{"name": "depth", "scale": 0.9}, {"name": "union", "scale": 1.2, "mode": "canny", "end": 0.6}]
    out, prepared, job = ed.edit(png(img), png(mask), "a red hat", seed=3, steps=STEPS, guidance=3.5,
                                 raw_output=True, template_seed=3, controls=controls, control_images=[png(a), png(b)])
    nets = [FluxControlNetModel.from_pretrained(d / "controlnets" / n) for n in ("depth", "union")]
    pipe = FluxControlNetInpaintPipeline.from_pretrained(d, controlnet=FluxMultiControlNetModel(nets))
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt="a red hat", image=img, mask_image=Image.fromarray(mask), control_image=[a, b], height=256,
               width=256, strength=1.0, num_inference_steps=STEPS, guidance_scale=3.5, max_sequence_length=MAX_SEQ,
               controlnet_conditioning_scale=[0.9, 1.2], control_guidance_start=[0.0, 0.0],
               control_guidance_end=[1.0, 0.6], control_mode=[None, 0],
               generator=torch.Generator("cpu").manual_seed(3), output_type="latent").images
    np.testing.assert_allclose(job.result(), ref[0].numpy(), atol=1e-5, rtol=0)
    assert Image.open(io.BytesIO(out)).size == img.size


def test_concurrent_requests_with_and_without_controls_through_the_engine_equal_each_alone(served):
    ed, _ = served
    img, mask, a = template(seed=4), box_mask(), edges(seed=5)
    asks = [([], []), ([{"name": "canny", "scale": 0.8}], [png(a)]),
            ([{"name": "union", "mode": "depth", "start": 0.3}], [png(a)])]
    inputs = engine_inputs(ed, img, mask, asks, seed=10, steps=STEPS)
    alone = [run_job(ed.engine, x).result() for x in inputs]
    results = concurrently(ed.engine, inputs)
    for x, y in zip(results, alone):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    assert max(np.abs(alone[0] - alone[1]).max(), np.abs(alone[0] - alone[2]).max()) > 1e-2


@pytest.mark.parametrize("controls,images,field,words", [
    ([{"name": "nope"}], 1, "CONTROLS", "unknown ControlNet"),
    ([{"name": "union"}], 1, "CONTROLS", "union"),
    ([{"name": "canny", "mode": "depth"}], 1, "CONTROLS", "no \"mode\""),
    ([{"name": "union", "mode": "lineart"}], 1, "CONTROLS", "not a Flux union mode"),
    ([{"name": "sdxl"}], 1, "CONTROLS", "another model family"),
    ([{"name": "canny"}], 0, "CONTROL_IMAGES", "no image"),
])
def test_bad_controls_name_the_field(served, controls, images, field, words):
    ed, d = served
    (d / "controlnets" / "sdxl").mkdir(exist_ok=True)
    (d / "controlnets" / "sdxl" / "config.json").write_text(json.dumps({"_class_name": "ControlNetModel"}))
    with pytest.raises(InvalidInput) as e:
        ed.edit(png(template()), png(box_mask()), "x", steps=1, controls=controls,
                control_images=[png(edges())] * images)
    assert e.value.field == field and words in str(e.value)
    out, _, job = ed.edit(png(template()), png(box_mask()), "x", steps=1)  # and the editor keeps serving
    assert job is not None and job.done


def _stock_cropped_latents(pipe, img, mask, control_image, pad, seed, **kw):
    """``FluxControlNetInpaintPipeline`` with ``padding_mask_crop``: its final latents (its check refuses
    ``output_type="latent"`` with a crop, so they are taken at the last step's callback, after its blend)."""
    seen = {}

    def keep(p, i, t, kwargs):
        seen["latents"] = kwargs["latents"]
        return {}
    pipe(prompt="a red hat", image=img, mask_image=Image.fromarray(mask), control_image=control_image, height=256,
         width=256, strength=1.0, num_inference_steps=STEPS, guidance_scale=3.5, max_sequence_length=MAX_SEQ,
         padding_mask_crop=pad, generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=keep,
         callback_on_step_end_tensor_inputs=["latents"], **kw)
    return seen["latents"][0].numpy()


def test_padding_mask_crop_with_controlnets_equals_the_stock_pipeline(served):
    """PADDING_MASK_CROP with one ControlNet and with two: the template and mask are cropped, the control images
    are not (``FluxControlNetInpaintPipeline.prepare_image`` resizes them whole, as without a crop; a control image
    of another size included): the served latents equal the stock pipeline's."""
    ed, d = served
    img, mask = template(seed=6), box_mask()
    a, b = edges(seed=7), edges(w=192, h=320, seed=8)
    cases = [([{"name": "canny", "scale": 0.8}], [a], dict(controlnet_conditioning_scale=0.8)),
             ([{"name": "depth", "scale": 0.9}, {"name": "union", "scale": 1.2, "mode": "canny", "end": 0.6}], [a, b],
              dict(controlnet_conditioning_scale=[0.9, 1.2], control_guidance_start=[0.0, 0.0],
                   control_guidance_end=[1.0, 0.6], control_mode=[None, 0]))]
    for controls, images, kw in cases:
        _, p, job = ed.edit(png(img), png(mask), "a red hat", seed=4, steps=STEPS, guidance=3.5, raw_output=True,
                            template_seed=4, controls=controls, control_images=[png(i) for i in images],
                            padding_mask_crop=8)
        x1, y1, x2, y2 = p.crop
        assert (x2 - x1, y2 - y1) < img.size and p.crop != (0, 0, *img.size)  # the crop matters
        nets = [FluxControlNetModel.from_pretrained(d / "controlnets" / c["name"]) for c in controls]
        pipe = FluxControlNetInpaintPipeline.from_pretrained(
            d, controlnet=nets[0] if len(nets) == 1 else FluxMultiControlNetModel(nets))
        pipe.set_progress_bar_config(disable=True)
        ref = _stock_cropped_latents(pipe, img, mask, images[0] if len(images) == 1 else images, 8, 4, **kw)
        np.testing.assert_allclose(job.result(), ref, atol=1e-5, rtol=0)


def test_a_cropped_request_with_a_controlnet_is_cached_as_one_without_a_crop(served, tmp_path):
    """PADDING_MASK_CROP with a ControlNet caches as a ControlNet request without a crop: the first run records the
    transformer and the ControlNet (its key covers the box and the control), the next hits in both, computing the
    masked tokens of the crop only, within 1e-5 of the first."""
    from maskedit.cache.runtime import CacheRuntime
    from maskedit.cache.store import ActivationStore
    from maskedit.families import family_for
    from maskedit_lab.harness.baselines import cache_policy

    _, d = served
    s = load_settings({"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DEVICE": "cpu"})
    store = ActivationStore(tmp_path / "mem", tmp_path / "disk", 1 << 30, 1 << 30)
    ed = LocalEditor(s, store=store, cache=lambda t: CacheRuntime(
        family_for(d).cache_hooks(t), store, policy=cache_policy("planner")))
    img, mask, ctrl = template(seed=9), box_mask(), edges(seed=10)
    try:
        runs = []
        for _ in range(2):
            _, p, job = ed.edit(png(img), png(mask), "a red hat", seed=2, steps=STEPS, guidance=3.5, raw_output=True,
                                template_seed=2, controls=[{"name": "canny", "scale": 0.8}],
                                control_images=[png(ctrl)], padding_mask_crop=8)
            ed.runner.cache.flush()
            runs.append((p, job))
        (p, first), (_, again) = runs
        assert p.crop != (0, 0, *img.size) and p.cache_key
        assert first.cache.status == "record" and [c.status for c in first.control_cache] == ["record"]
        masked = int(np.asarray(p.token_mask).sum())
        assert again.cache.status == "hit" and again.cache.idx_c.numel() == masked < p.latents.shape[0]
        assert [c.status for c in again.control_cache] == ["hit"]
        np.testing.assert_allclose(again.result(), first.result(), atol=1e-5, rtol=0)
    finally:
        ed.close()
