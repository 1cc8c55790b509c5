"""Qwen-Image-Edit inpainting served like the other families: one real tritonserver behind the router, the same
client, the OpenAI endpoint; parity with stock Diffusers, the cache, guidance, errors by name."""

import base64
import io
import re
import urllib.request

import numpy as np
import openai
import pytest
import torch
from diffusers import QwenImageEditInpaintPipeline
from PIL import Image

from maskedit import samples
from maskedit.build_model import build
from maskedit.families import family_for
from maskedit.launcher import free_port
from maskedit_client import EditClient, EditError
from maskedit_lab.harness.cluster import running_cluster
from tests.conftest import png

SIZE = 1024  # the pipeline works at about 1024 x 1024: a template of that size is not resized on the way back


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    model = build(d / "model", "qwen-edit-tiny")
    port = free_port()
    env = {"MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
           "MASKEDIT_CACHE_DISK_DIR": str(d / "disk")}
    # The pipeline decodes 1 MP images (a few seconds each on a busy CPU): the router's health probe, which queues
    # behind them, gets the time they take.
    health = {"probe_timeout_s": 60.0}
    with running_cluster(1, d / "cluster", openai_port=port, env=env, health=health) as (router, url, servers):
        with EditClient(url) as client:
            yield model, client, port, servers[0]


@pytest.fixture(scope="module")
def stock(qwen):
    model = qwen[0]
    pipe = QwenImageEditInpaintPipeline.from_pretrained(model, **family_for(model).pipeline_kwargs())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _mask(box=(256, 320, 640, 768)):
    m = np.zeros((SIZE, SIZE), np.uint8)
    y0, x0, y1, x1 = box
    m[y0:y1, x0:x1] = 255
    return m


def _close(served: Image.Image, ref: Image.Image) -> None:
    # Exact in one process (tests/unit/maskedit/families); Triton's processes run with their own thread counts, whose
    # reduction order moves a few pixels by one level, as for SDXL and klein.
    assert np.abs(np.asarray(served).astype(int) - np.asarray(ref).astype(int)).max() <= 1


def test_served_through_the_router_equals_stock_qwen_image_edit(qwen, stock):
    _, client, _, _ = qwen
    tpl, mask = samples.template(SIZE, SIZE, seed=3), _mask()
    r = client.edit(tpl, mask, "a red hat", seed=11, steps=3, raw_output=True, template_seed=11, use_cache=False)
    ref = stock(prompt="a red hat", image=tpl, mask_image=Image.fromarray(mask), num_inference_steps=3, strength=1.0,
                true_cfg_scale=1.0, generator=torch.Generator("cpu").manual_seed(11)).images[0]
    _close(r.image, ref)


def test_guided_edit_equals_stock_and_runs_uncached(qwen, stock):
    """GUIDANCE (true_cfg_scale) with a NEGATIVE_PROMPT: the pipeline's second call per step; never cached."""
    _, client, _, _ = qwen
    tpl, mask = samples.template(SIZE, SIZE, seed=4), _mask((128, 128, 512, 512))
    r = client.edit(tpl, mask, "a red hat", seed=5, steps=2, raw_output=True, template_seed=5, guidance=4.0,
                    negative_prompt="blurry")
    assert r.info["cache"] == "off", r.info
    ref = stock(prompt="a red hat", negative_prompt="blurry", image=tpl, mask_image=Image.fromarray(mask),
                num_inference_steps=2, strength=1.0, true_cfg_scale=4.0,
                generator=torch.Generator("cpu").manual_seed(5)).images[0]
    _close(r.image, ref)


def test_template_then_edits_hit_the_cache(qwen):
    """The activation cache (recorded, then two hits in one batch) and the prompt cache (one template, one prompt:
    encoded once, then taken from pre-processing's cache)."""
    _, client, _, server = qwen
    hits_before = _prompt_cache_hits(server)
    tpl = samples.template(SIZE, SIZE, seed=41)
    reg = client.edit(tpl, np.zeros((SIZE, SIZE), np.uint8), "a hat", steps=3, register=True)
    assert reg.info["cache"] == "record"
    hits = [client.submit(tpl, samples.mask(SIZE, SIZE, 0.2, "blob", seed=s), "a hat", steps=3, seed=s)
            for s in (3, 4)]  # two edits in one running batch
    for f in hits:
        info = f.result(600).info
        assert info["cache_hit"] and set(info["block_modes"]) - {"F"}, info
        assert 0 < info["computed_tokens"] < 16 * 16
    assert _prompt_cache_hits(server) >= hits_before + 2


def _prompt_cache_hits(server) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    found = re.search(r'maskedit_prompt_cache_total\{event="hit"\} (\d+)', text)
    assert found, "no prompt cache metric"
    return int(found.group(1))


def test_openai_edit_and_errors_by_name(qwen):
    _, client, port, _ = qwen
    tpl, mask = samples.template(512, 384, seed=2), samples.mask(512, 384, 0.2, "box", seed=2)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        out = api.images.edit(image=("t.png", png(np.asarray(tpl)), "image/png"),
                              mask=("m.png", png(mask), "image/png"), prompt="a red hat",
                              extra_body={"steps": 2, "seed": 3})
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))
        assert img.shape[:2] == (384, 512)  # edited at the pipeline's size, returned at the template's
    finally:
        api.close()
    with pytest.raises(EditError) as e:  # one step: refused by name, and the server keeps serving
        client.edit(tpl, mask, "a hat", steps=1)
    assert e.value.field == "STEPS"
    assert client.edit(tpl, mask, "a hat", steps=2).image.size == (512, 384)
