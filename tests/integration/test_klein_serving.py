"""FLUX.2 [klein] inpainting, the family added through the family protocol, served like the others: a real
tritonserver behind the router, the same client, the OpenAI endpoint; parity with stock Diffusers, the cache."""

import base64
import io

import numpy as np
import openai
import pytest
import torch
from diffusers import Flux2KleinInpaintPipeline
from PIL import Image

from maskedit import samples
from maskedit.build_model import build
from maskedit.launcher import free_port
from maskedit_client import EditClient, EditError
from maskedit_lab.harness.cluster import running_cluster
from tests.conftest import png


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    d = tmp_path_factory.mktemp("klein")
    model = build(d / "model", "klein-tiny")
    port = free_port()
    env = {"MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
           "MASKEDIT_CACHE_DISK_DIR": str(d / "disk")}
    with running_cluster(1, d / "cluster", openai_port=port, env=env) as (router, url, servers):
        with EditClient(url) as client:
            yield model, client, servers[0], port


def test_served_through_the_router_equals_stock_klein_inpainting(klein, template_img, box_mask):
    model, client, _, _ = klein
    r = client.edit(template_img, box_mask, "a red hat", seed=11, steps=3, raw_output=True, template_seed=11,
                    use_cache=False)
    stock = Flux2KleinInpaintPipeline.from_pretrained(model)
    stock.set_progress_bar_config(disable=True)
    ref = stock(prompt="a red hat", image=template_img, mask_image=Image.fromarray(box_mask), num_inference_steps=3,
                strength=1.0, guidance_scale=1.0, max_sequence_length=64,
                generator=torch.Generator("cpu").manual_seed(11)).images[0]
    # Exact in one process (tests/unit/maskedit/families); Triton's processes run with their own thread counts, whose
    # reduction order moves a few pixels by one level, as for SDXL.
    assert np.abs(np.asarray(r.image).astype(int) - np.asarray(ref).astype(int)).max() <= 1


def test_template_then_edits_hit_the_cache(klein):
    model, client, _, _ = klein
    tpl = samples.template(256, 256, seed=41)
    reg = client.edit(tpl, np.zeros((256, 256), np.uint8), "a hat", steps=3, register=True)
    assert reg.info["cache"] == "record"
    hits = [client.submit(tpl, samples.mask(256, 256, 0.2, "blob", seed=s), "a hat", steps=3, seed=s)
            for s in (3, 4)]  # two edits in one running batch
    for f in hits:
        info = f.result(120).info
        assert info["cache_hit"] and set(info["block_modes"]) - {"F"}, info
        assert 0 < info["computed_tokens"] < 16 * 16


def test_openai_edit_and_errors_by_name(klein, template_img, box_mask):
    model, client, _, port = klein
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        out = api.images.edit(image=("t.png", png(np.asarray(template_img)), "image/png"),
                              mask=("m.png", png(box_mask), "image/png"), prompt="a red hat",
                              extra_body={"steps": 2, "seed": 3})
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))
        assert img.shape[:2] == (256, 256)
    finally:
        api.close()
    with pytest.raises(EditError) as e:  # no negative row: refused by name, and the server keeps serving
        client.edit(template_img, box_mask, "a hat", steps=2, negative_prompt="blur")
    assert e.value.field == "NEGATIVE_PROMPT"
    assert client.edit(template_img, box_mask, "a hat", steps=2).image.size == (256, 256)


def test_reference_images_served_equal_stock(klein, template_img, box_mask):
    """Two reference images (the stock pipeline's ``image_reference`` list) through the router."""
    model, client, _, _ = klein
    refs = [samples.template(256, 256, seed=s) for s in (51, 52)]
    r = client.edit(template_img, box_mask, "a red hat", seed=5, steps=3, raw_output=True, template_seed=5,
                    reference_images=refs, use_cache=False)
    stock = Flux2KleinInpaintPipeline.from_pretrained(model)
    stock.set_progress_bar_config(disable=True)
    ref = stock(prompt="a red hat", image=template_img, image_reference=refs, mask_image=Image.fromarray(box_mask),
                num_inference_steps=3, strength=1.0, guidance_scale=1.0, max_sequence_length=64,
                generator=torch.Generator("cpu").manual_seed(5)).images[0]
    assert np.abs(np.asarray(r.image).astype(int) - np.asarray(ref).astype(int)).max() <= 1
