"""SDXL inpainting through a real tritonserver (the same model repository, API and client as Flux Fill): parity
with the stock pipeline, the activation cache, and errors."""

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLInpaintPipeline
from PIL import Image

from maskedit import samples
from maskedit.launcher import TritonServer
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit_client import EditClient, EditError


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    d = tmp_path_factory.mktemp("sdxl")
    model = build_unet(d / "model", "sdxl-tiny")
    server = TritonServer(log_path=d / "tritonserver.log", env={
        "MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
        "MASKEDIT_CACHE_DISK_DIR": str(d / "disk")})
    server.start(timeout=300)
    client = EditClient(server.grpc_url)
    try:
        yield model, client
    finally:
        client.close()
        server.stop()


def test_served_image_equals_stock_sdxl_inpainting(sdxl, template_img, box_mask):
    """With a negative prompt, which travels as its own tensor through the ensemble."""
    model, client = sdxl
    r = client.edit(template_img, box_mask, "a red hat", seed=11, steps=3, guidance=7.5, raw_output=True,
                    template_seed=11, use_cache=False, negative_prompt="blurry, low quality")
    stock = StableDiffusionXLInpaintPipeline.from_pretrained(model)
    stock.set_progress_bar_config(disable=True)
    ref = stock(prompt="a red hat", image=template_img, mask_image=Image.fromarray(box_mask), height=256, width=256,
                num_inference_steps=3, guidance_scale=7.5, strength=1.0, negative_prompt="blurry, low quality",
                generator=torch.Generator("cpu").manual_seed(11)).images[0]
    served = np.asarray(r.image).astype(int)
    assert served.shape == np.asarray(ref).shape
    assert np.abs(served - np.asarray(ref).astype(int)).max() <= 1


def test_template_then_edits_hit_the_cache_in_the_unet(sdxl):
    model, client = sdxl
    tpl = samples.template(256, 256, seed=31)
    reg = client.edit(tpl, np.zeros((256, 256), np.uint8), "a hat", steps=3, register=True)
    assert reg.info["cache"] == "record"
    hit = client.edit(tpl, samples.mask(256, 256, 0.2, "blob", seed=3), "a hat", steps=3)
    assert hit.info["cache_hit"] and set(hit.info["block_modes"]) - {"F"}
    assert 0 < hit.info["computed_tokens"] < 32 * 32
    assert hit.image.size == (256, 256)


def test_prompt_over_clips_77_tokens_is_refused_by_name(sdxl, template_img, box_mask):
    model, client = sdxl
    with pytest.raises(EditError) as e:
        client.edit(template_img, box_mask, " ".join(["red"] * 100), steps=2)
    assert "PROMPT" in str(e.value) and "77" in str(e.value)
    with pytest.raises(EditError) as e:
        client.edit(template_img, box_mask, "a hat", steps=2, negative_prompt=" ".join(["red"] * 100))
    assert e.value.field == "NEGATIVE_PROMPT" and "77" in str(e.value)
    ok = client.edit(template_img, box_mask, "a hat", steps=2)  # and the server keeps serving
    assert ok.image.size == (256, 256)
