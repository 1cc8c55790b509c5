"""Flux ControlNet inpainting (the ``flux_controlnet`` family) served by a real tritonserver: two ControlNets over
gRPC equal stock ``FluxControlNetInpaintPipeline``; requests with and without controls hit the activation cache; a bad control
fails its request by name and the server keeps serving."""

import numpy as np
import pytest
import torch
from diffusers import FluxControlNetInpaintPipeline, FluxControlNetModel, FluxMultiControlNetModel
from PIL import Image

from maskedit import samples
from maskedit.build_model import build
from maskedit.launcher import TritonServer
from maskedit_client import EditClient, EditError
from tests.unit.maskedit.families.cn_util import edges


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux-cn")
    model = build(d / "model", "flux-cn-tiny")
    s = TritonServer(log_path=d / "tritonserver.log", env={
        "MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
        "MASKEDIT_CACHE_DISK_DIR": str(d / "disk")})
    s.start(timeout=300)
    try:
        with EditClient(s.grpc_url) as client:
            yield model, client
    finally:
        s.stop()


def test_two_controlnets_served_equal_the_stock_pipeline(served, template_img, box_mask):
    model, client = served
    a, b = edges(seed=1), edges(seed=2)
    r = client.edit(template_img, box_mask, "a red hat", seed=5, steps=3, guidance=3.5, raw_output=True,
                    template_seed=5, use_cache=False,
                    controls=[{"name": "canny", "scale": 0.8}, {"name": "union", "mode": "depth", "end": 0.6}],
                    control_images=[a, b])
    nets = [FluxControlNetModel.from_pretrained(model / "controlnets" / n) for n in ("canny", "union")]
    stock = FluxControlNetInpaintPipeline.from_pretrained(model, controlnet=FluxMultiControlNetModel(nets))
    stock.set_progress_bar_config(disable=True)
    ref = stock(prompt="a red hat", image=template_img, mask_image=Image.fromarray(box_mask), control_image=[a, b],
                height=256, width=256, strength=1.0, num_inference_steps=3, guidance_scale=3.5,
                max_sequence_length=64, controlnet_conditioning_scale=[0.8, 1.0], control_guidance_start=[0.0, 0.0],
                control_guidance_end=[1.0, 0.6], control_mode=[None, 2],
                generator=torch.Generator("cpu").manual_seed(5)).images[0]
    # Exact in one process (tests/unit/maskedit/families); Triton's processes run with their own thread counts, whose
    # reduction order may move a pixel by a level.
    assert np.abs(np.asarray(r.image).astype(int) - np.asarray(ref).astype(int)).max() <= 1


def test_template_then_edits_without_controls_hit_the_cache(served):
    _, client = served
    tpl = samples.template(256, 256, seed=41)
    assert client.edit(tpl, np.zeros((256, 256), np.uint8), "a hat", steps=3, register=True).info["cache"] == \
        "record"
    info = client.edit(tpl, samples.mask(256, 256, 0.2, "blob", seed=3), "a hat", steps=3, seed=3).info
    assert info["cache_hit"] and 0 < info["computed_tokens"] < 16 * 16, info
    ask = lambda scale, seed: client.edit(tpl, samples.mask(256, 256, 0.2, "blob", seed=3), "a hat", steps=3,  # noqa
                                          seed=seed, controls=[("canny", scale)], control_images=[edges(seed=3)])
    ctrl = ask(0.5, 3).info
    assert not ctrl["cache_hit"] and ctrl["cache"] == "record"  # the control is in the key: a miss, recorded
    again = ask(0.5, 4).info  # the same control, another seed: a hit (ControlNet and transformer on masked rows)
    assert again["cache_hit"] and again["computed_tokens"] == info["computed_tokens"], again
    assert not ask(0.4, 3).info["cache_hit"]  # another scale: another key


def test_bad_control_is_refused_by_name_and_the_server_keeps_serving(served, template_img, box_mask):
    _, client = served
    with pytest.raises(EditError) as e:
        client.edit(template_img, box_mask, "a hat", steps=2, controls=[("nope", 1.0)], control_images=[edges()])
    assert e.value.field == "CONTROLS" and "nope" in str(e.value)
    assert client.edit(template_img, box_mask, "a hat", steps=2).image.size == (256, 256)
