"""SDXL inpainting through a real tritonserver (the same model repository, API and client as Flux Fill): parity
with the stock pipeline, the activation cache, and errors."""

import re
import urllib.request

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLInpaintPipeline
from PIL import Image

from maskedit import samples
from maskedit.families import family_for
from maskedit.launcher import TritonServer
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit_client import EditClient, EditError


@pytest.fixture(scope="module")
def sdxl_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("sdxl")
    model = build_unet(d / "model", "sdxl-tiny")
    family_for(model).build_controlnets(model / "controlnets")  # the library, as `make model` writes it
    server = TritonServer(log_path=d / "tritonserver.log", env={
        "MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
        "MASKEDIT_CACHE_DISK_DIR": str(d / "disk")})
    server.start()
    client = EditClient(server.grpc_url)
    try:
        yield model, client, server
    finally:
        client.close()
        server.stop()


@pytest.fixture(scope="module")
def sdxl(sdxl_server):
    return sdxl_server[:2]


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


CONTROLS = [{"name": "canny", "scale": 0.8}, {"name": "depth", "scale": 0.5, "start": 0.3, "end": 0.9}]


def test_two_controlnets_served_over_grpc_equal_the_stock_controlnet_pipeline(sdxl, template_img, box_mask):
    """CONTROLS and CONTROL_IMAGES through the ensemble (preprocess resizes the control images, CONTROL_COND carries
    them to the denoiser, the UNet family adds both ControlNets' residuals) against
    ``StableDiffusionXLControlNetInpaintPipeline`` with a ``MultiControlNetModel`` of the same two ControlNets."""
    from diffusers import ControlNetModel, DiffusionPipeline, StableDiffusionXLControlNetInpaintPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    model, client = sdxl
    ctl = [samples.template(256, 256, seed=41), samples.template(192, 320, seed=42)]
    r = client.edit(template_img, box_mask, "a red hat", seed=11, steps=3, guidance=7.5, raw_output=True,
                    template_seed=11, controls=CONTROLS, control_images=ctl)
    assert r.info["controls"][1]["name"] == "depth" and r.info["cache"] == "record"  # recording changes nothing
    assert r.info["control_s"] > 0
    nets = MultiControlNetModel([ControlNetModel.from_pretrained(model / "controlnets" / n) for n in ("canny", "depth")])
    stock = StableDiffusionXLControlNetInpaintPipeline(**DiffusionPipeline.from_pretrained(model).components,
                                                       controlnet=nets)
    stock.set_progress_bar_config(disable=True)
    ref = stock(prompt="a red hat", image=template_img, mask_image=Image.fromarray(box_mask), control_image=ctl,
                height=256, width=256, num_inference_steps=3, guidance_scale=7.5, strength=1.0,
                controlnet_conditioning_scale=[0.8, 0.5], control_guidance_start=[0.0, 0.3],
                control_guidance_end=[1.0, 0.9], generator=torch.Generator("cpu").manual_seed(11)).images[0]
    served = np.asarray(r.image).astype(int)
    assert np.abs(served - np.asarray(ref).astype(int)).max() <= 1


def test_controls_over_http_generate(sdxl_server, template_img, box_mask):
    """The same request as JSON on Triton's HTTP generate endpoint: CONTROL_IMAGES a list of base64 images."""
    import base64
    import json
    import urllib.request

    from tests.conftest import png

    model, client, server = sdxl_server
    ctl = [samples.template(256, 256, seed=41)]
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    doc = {"TEMPLATE": b64(png(template_img)), "MASK": b64(png(box_mask)), "PROMPT": "a red hat", "SEED": 3,
           "STEPS": 2, "CONTROLS": json.dumps(CONTROLS[:1]), "CONTROL_IMAGES": [b64(png(c)) for c in ctl]}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/edit/generate", json.dumps(doc).encode(),
                                 method="POST")
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    over_http = np.asarray(Image.open(__import__("io").BytesIO(base64.b64decode(out["IMAGE"]))))
    over_grpc = client.edit(template_img, box_mask, "a red hat", seed=3, steps=2, controls=CONTROLS[:1],
                            control_images=ctl, use_cache=False)  # the full computation, as the HTTP one recorded
    assert json.loads(out["EDIT_INFO"])["controls"][0]["name"] == "canny"
    np.testing.assert_array_equal(over_http, np.asarray(over_grpc.image))


def _control_cache_counts(server) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    got = re.findall(r'maskedit_controlnet_cache_total\{placement="inprocess",status="(\w+)"\} (\d+)', text)
    return {st: int(n) for st, n in got}


def test_a_repeated_controlled_edit_is_a_cache_hit_close_to_the_first(sdxl_server):
    """Requests with controls are cached (docs/controlnet.md, Execution): the same edit with two ControlNets (one
    windowed) again on its template is a hit in the UNet and in both ControlNets, within 1 grey level of the first;
    the metrics port counts each control's cache status."""
    model, client, server = sdxl_server
    before = _control_cache_counts(server)
    tpl, mask = samples.template(256, 256, seed=51), samples.mask(256, 256, 0.2, "box", seed=5)
    ctl = [samples.template(256, 256, seed=52), samples.template(256, 256, seed=53)]
    first, again = (client.edit(tpl, mask, "a hat", seed=4, steps=3, controls=CONTROLS, control_images=ctl)
                    for _ in range(2))
    assert first.info["cache"] == "record" and first.info["control_cache"] == ["record", "record"]
    assert again.info["cache"] == "hit" and again.info["control_cache"] == ["hit", "hit"]
    assert 0 < again.info["computed_tokens"] < 32 * 32  # 256 px: 32 x 32 latents, the box's computed
    assert np.abs(np.asarray(again.image).astype(int) - np.asarray(first.image).astype(int)).max() <= 1
    after = _control_cache_counts(server)
    assert after.get("record", 0) - before.get("record", 0) == 2 and after.get("hit", 0) - before.get("hit", 0) == 2


@pytest.mark.parametrize("controls, images, field, words", [
    ([{"name": "nope"}], 1, "CONTROLS", "unknown ControlNet 'nope'"),
    ([{"name": "canny"}, {"name": "depth"}], 1, "CONTROL_IMAGES", "control 1: has no image"),
    (None, 1, "CONTROLS", "names no ControlNet for this image"),
    ([{"name": "canny"}], "1x1", "CONTROL_IMAGES", "control 0: image is 1x1"),
    ([{"name": "canny", "end": 2}], 1, "CONTROLS", "control 0: start and end must lie in [0, 1]"),
])
def test_bad_controls_are_refused_by_name_and_the_server_keeps_serving(sdxl, template_img, box_mask, controls,
                                                                        images, field, words):
    model, client = sdxl
    imgs = [np.zeros((1, 1, 3), np.uint8)] if images == "1x1" else [samples.template(64, 64, seed=1)] * images
    with pytest.raises(EditError) as e:
        client.edit(template_img, box_mask, "a hat", steps=2, controls=controls, control_images=imgs)
    assert e.value.code == "INVALID_ARGUMENT" and f"{field}: " in str(e.value) and words in str(e.value), str(e.value)
    ok = client.edit(template_img, box_mask, "a hat", steps=2)
    assert ok.image.size == (256, 256)
