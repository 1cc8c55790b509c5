"""FLUX.1 Kontext inpainting served like the other families: a real tritonserver behind the router, the same client,
the OpenAI endpoint (its ``image[]`` after the first are reference images); parity with stock Diffusers, the cache
with reference rows, bad reference images refused by name while the server keeps serving."""

import base64
import io

import numpy as np
import openai
import pytest
import torch
from diffusers import FluxKontextInpaintPipeline
from PIL import Image

from maskedit import samples
from maskedit.build_model import build
from maskedit.launcher import free_port
from maskedit_client import EditClient, EditError
from maskedit_lab.harness.cluster import running_cluster
from tests.conftest import png


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    d = tmp_path_factory.mktemp("kontext")
    model = build(d / "model", "kontext-tiny")
    port = free_port()
    env = {"MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
           "MASKEDIT_CACHE_DISK_DIR": str(d / "disk")}
    with running_cluster(1, d / "cluster", openai_port=port, env=env) as (router, url, servers):
        with EditClient(url) as client:
            yield model, client, port


def _stock(model, tpl, mask, prompt, seed, steps, reference=None):
    pipe = FluxKontextInpaintPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=prompt, image=tpl, mask_image=Image.fromarray(mask), image_reference=reference, height=256,
                width=256, max_area=256 * 256, _auto_resize=False, num_inference_steps=steps, strength=1.0,
                guidance_scale=2.5, max_sequence_length=64, generator=torch.Generator("cpu").manual_seed(seed)).images[0]


@pytest.mark.parametrize("with_reference", [False, True])
def test_served_through_the_router_equals_stock_kontext_inpainting(kontext, template_img, box_mask, with_reference):
    model, client, _ = kontext
    ref = samples.template(256, 256, seed=5) if with_reference else None
    r = client.edit(template_img, box_mask, "make the hat red", seed=11, steps=3, raw_output=True, template_seed=11,
                    use_cache=False, reference_images=[ref] if ref is not None else None)
    theirs = _stock(model, template_img, box_mask, "make the hat red", 11, 3, ref)
    # Exact in one process (tests/unit/maskedit/test_reference_images.py); Triton's processes run with their own
    # thread counts, whose reduction order may move a pixel by one level.
    assert np.abs(np.asarray(r.image).astype(int) - np.asarray(theirs).astype(int)).max() <= 1


def test_template_then_edits_hit_the_cache_with_reference_rows(kontext):
    model, client, _ = kontext
    tpl, ref = samples.template(256, 256, seed=41), samples.template(256, 256, seed=42)
    reg = client.register_template(tpl, "a hat", steps=3, reference_images=[ref])
    assert reg.info["cache"] == "record" and reg.info["reference_images"] == 1
    miss = client.edit(tpl, samples.mask(256, 256, 0.2, "blob", seed=3), "a hat", steps=3, seed=3)
    assert miss.info["cache"] == "record"  # no reference image: another key
    # two edits in one running batch; STRENGTH 0.5 from the strength-1 entry (Kontext blends the template back: one
    # entry serves every strength)
    hits = [client.submit(tpl, samples.mask(256, 256, 0.2, "blob", seed=s), "a hat", steps=3, seed=s,
                          reference_images=[ref], strength=strength) for s, strength in ((3, None), (4, 0.5))]
    for f in hits:
        info = f.result(120).info
        assert info["reference_images"] == 1
        assert info["cache_hit"] and set(info["block_modes"]) - {"F"}, info
        assert 0 < info["computed_tokens"] == info["masked_tokens"], info  # no reference token computed


def test_openai_edit_with_a_reference_and_errors_by_name(kontext, template_img, box_mask):
    model, client, port = kontext
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    tpl, ref = png(np.asarray(template_img)), png(np.asarray(samples.template(256, 256, seed=5)))
    try:
        out = api.images.edit(image=[("t.png", tpl, "image/png"), ("r.png", ref, "image/png")],
                              mask=("m.png", png(box_mask), "image/png"), prompt="make the hat red",
                              extra_body={"steps": 2, "seed": 3})
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))
        assert img.shape[:2] == (256, 256)
        with pytest.raises(openai.BadRequestError) as e:  # Kontext takes one reference image
            api.images.edit(image=[("t.png", tpl, "image/png"), ("r.png", ref, "image/png"),
                                   ("s.png", ref, "image/png")],
                            mask=("m.png", png(box_mask), "image/png"), prompt="x", extra_body={"steps": 2})
        assert e.value.body["param"] == "image" and "above the limit of 1" in e.value.body["message"]
    finally:
        api.close()
    with pytest.raises(EditError) as e:
        client.edit(template_img, box_mask, "a hat", steps=2, reference_images=[b"not an image"])
    assert e.value.field == "REFERENCE_IMAGES" and "reference 0" in str(e.value)
    assert client.edit(template_img, box_mask, "a hat", steps=2).image.size == (256, 256)
