"""Flux ControlNet inpainting (the ``flux_controlnet`` family) served by a real tritonserver whose ControlNets run in
the ``controlnet`` Triton model (``MASKEDIT_CONTROLNET_PLACEMENT=triton``, residuals through BLS): two ControlNets over
gRPC equal stock ``FluxControlNetInpaintPipeline`` and the in-process path (``LocalEditor``); requests without
controls hit the activation cache and requests with controls run uncached (the placement's fallback); a bad control
fails its request by name, a ControlNet the controlnet model cannot run fails only its request, and the server keeps
serving. A second server with a timeout smaller than any real ControlNet call shows the timeout failing only the
requests that used the controlnet model. A third server runs the default placement (``inprocess``), where a
request's ControlNets are cached with the transformer: it equals the stock pipeline too, and a repeated control is
a hit that computes only masked rows."""

import contextlib
import io
import shutil
import threading

import numpy as np
import pytest
import torch
from diffusers import FluxControlNetInpaintPipeline, FluxControlNetModel, FluxMultiControlNetModel
from PIL import Image

from maskedit import samples
from maskedit.build_model import build
from maskedit.launcher import TritonServer
from maskedit.local import LocalEditor
from maskedit.settings import load_settings
from maskedit_client import EditClient, EditError
from tests.conftest import png
from tests.unit.maskedit.families.cn_util import edges


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux-cn-model")
    model = build(d / "model", "flux-cn-tiny")
    broken = model / "controlnets" / "broken"  # a valid config (admitted) with weights the controlnet model cannot load
    shutil.copytree(model / "controlnets" / "canny", broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return model


@contextlib.contextmanager
def _serving(d, model, **env):
    """A started tritonserver on ``model`` (ControlNets placed in the controlnet model unless ``env`` says
    otherwise) and a client of it; stopped on exit."""
    s = TritonServer(log_path=d / "tritonserver.log", env={
        "MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
        "MASKEDIT_CACHE_DISK_DIR": str(d / "disk"), "MASKEDIT_CONTROLNET_PLACEMENT": "triton", **env})
    s.start()
    try:
        with EditClient(s.grpc_url) as client:
            yield client
    finally:
        s.stop()


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    with _serving(tmp_path_factory.mktemp("flux-cn"), model) as client:
        yield model, client


@pytest.fixture(scope="module")
def in_process(model, tmp_path_factory):
    """The default placement: the ControlNets run in the denoiser's process and are cached with the transformer."""
    with _serving(tmp_path_factory.mktemp("flux-cn-inprocess"), model,
                  MASKEDIT_CONTROLNET_PLACEMENT="inprocess") as client:
        yield model, client


@pytest.fixture(params=["triton", "inprocess"])
def each_placement(request):
    return request.getfixturevalue({"triton": "served", "inprocess": "in_process"}[request.param]), request.param


def _both(client, **kw):
    """Two requests sent together (threads): their results or errors, by key."""
    results = {}

    def send(key, extra):
        try:
            results[key] = client.edit(kw["img"], kw["mask"], "a hat", seed=3, steps=3, **extra)
        except EditError as e:
            results[key] = e
    threads = [threading.Thread(target=send, args=(k, v)) for k, v in kw["asks"].items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def test_two_controlnets_served_equal_the_stock_pipeline(each_placement, template_img, box_mask):
    (model, client), placement = each_placement
    a, b = edges(seed=1), edges(seed=2)
    r = client.edit(template_img, box_mask, "a red hat", seed=5, steps=3, guidance=3.5, raw_output=True,
                    template_seed=5, use_cache=False,
                    controls=[{"name": "canny", "scale": 0.8}, {"name": "union", "mode": "depth", "end": 0.6}],
                    control_images=[a, b])
    assert r.info["control_placement"] == placement
    if placement == "triton":
        assert r.info["control_bls_s"] >= r.info["control_model_s"] > 0
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


def _registered(client, seed):
    """A template registered, then an edit on it without controls (a hit: its info); and ``ask(scale, seed)``, the
    same edit with a canny control."""
    tpl, mask = samples.template(256, 256, seed=seed), samples.mask(256, 256, 0.2, "blob", seed=3)
    assert client.edit(tpl, np.zeros((256, 256), np.uint8), "a hat", steps=3, register=True).info["cache"] == \
        "record"
    info = client.edit(tpl, mask, "a hat", steps=3, seed=3).info
    assert info["cache_hit"] and 0 < info["computed_tokens"] < 16 * 16, info
    return info, lambda scale, s: client.edit(tpl, mask, "a hat", steps=3, seed=s, controls=[("canny", scale)],
                                              control_images=[edges(seed=3)])


def test_template_then_edits_without_controls_hit_the_cache(served):
    _, client = served
    info, ask = _registered(client, 41)
    # The ControlNet's rows live in the controlnet model's process, out of the cache's reach: requests with controls
    # run uncached under this placement (``ModelRunner._controls_cached``), and their batch-mates still hit.
    ctrl = ask(0.5, 3).info
    assert not ctrl["cache_hit"] and ctrl["cache"] == "off" and ctrl["control_bls_s"] > 0
    assert not ask(0.5, 4).info["cache_hit"]


def test_bls_images_equal_the_in_process_path(served, template_img, box_mask):
    model, client = served
    a, b = edges(seed=6), edges(seed=7)
    controls = [{"name": "depth", "scale": 0.9, "start": 0.3}, {"name": "union", "mode": "pose", "scale": 0.6}]
    local = LocalEditor(load_settings({"MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE": "off"}))
    try:
        for n in (1, 2):
            r = client.edit(template_img, box_mask, "a red hat", seed=11, steps=3, raw_output=True, template_seed=11,
                            use_cache=False, controls=controls[:n], control_images=[a, b][:n])
            ref, _, _ = local.edit(png(template_img), png(box_mask), "a red hat", seed=11, steps=3, raw_output=True,
                                   template_seed=11, controls=controls[:n], control_images=[png(a), png(b)][:n])
            served_img = np.asarray(r.image).astype(int)
            assert np.abs(served_img - np.asarray(Image.open(io.BytesIO(ref))).astype(int)).max() <= 1
    finally:
        local.close()


def test_a_failing_controlnet_call_fails_only_its_request(served, template_img, box_mask):
    _, client = served
    got = _both(client, img=template_img, mask=box_mask, asks={
        "plain": {}, "broken": dict(controls=[{"name": "broken"}], control_images=[edges(seed=5)])})
    assert not isinstance(got["plain"], EditError) and got["plain"].image.size == template_img.size
    err = got["broken"]
    assert isinstance(err, EditError) and err.code == "INTERNAL" and err.field == "CONTROLS"
    assert "the controlnet model failed for ControlNet 'broken'" in str(err) and "(OSError)" in str(err)
    ok = client.edit(template_img, box_mask, "a hat", seed=3, steps=2, controls=[("canny", 0.8)],
                     control_images=[edges(seed=5)])  # the server keeps serving controls
    assert ok.info["control_bls_s"] > 0


@pytest.fixture(scope="module")
def timing_out(model, tmp_path_factory):
    """A server whose controlnet calls must answer within 1 ms: less than any real ControlNet call takes (the
    smallest here computes for milliseconds, and its first call loads Diffusers and the weights)."""
    with _serving(tmp_path_factory.mktemp("flux-cn-timeout"), model, MASKEDIT_CONTROLNET_TIMEOUT_S="0.001") as client:
        yield client


def test_a_controlnet_call_over_its_timeout_fails_only_its_requests(timing_out, template_img, box_mask):
    client = timing_out
    for _ in range(2):  # the first call (loading) and a later one: each times out, the server keeps serving
        got = _both(client, img=template_img, mask=box_mask, asks={
            "plain": {}, "canny": dict(controls=[("canny", 0.8)], control_images=[edges(seed=8)])})
        assert not isinstance(got["plain"], EditError) and got["plain"].image.size == template_img.size
        err = got["canny"]
        assert isinstance(err, EditError) and err.code == "INTERNAL" and err.field == "CONTROLS"
        assert "the controlnet model failed for ControlNet 'canny': timed out after 0.001 s " \
               "(MASKEDIT_CONTROLNET_TIMEOUT_S)" in str(err)
    assert client.edit(template_img, box_mask, "a hat", steps=2).image.size == template_img.size


def test_bad_control_is_refused_by_name_and_the_server_keeps_serving(served, template_img, box_mask):
    _, client = served
    with pytest.raises(EditError) as e:
        client.edit(template_img, box_mask, "a hat", steps=2, controls=[("nope", 1.0)], control_images=[edges()])
    assert e.value.field == "CONTROLS" and "nope" in str(e.value)
    assert client.edit(template_img, box_mask, "a hat", steps=2).image.size == (256, 256)


def test_in_process_controls_are_cached_with_the_transformer(in_process):
    _, client = in_process
    plain, ask = _registered(client, 43)
    ctrl = ask(0.5, 3).info
    assert not ctrl["cache_hit"] and ctrl["cache"] == "record"  # the control is in the key: a miss, recorded
    again = ask(0.5, 4).info  # the same control, another seed: a hit (ControlNet and transformer on masked rows)
    assert again["cache_hit"] and again["computed_tokens"] == plain["computed_tokens"], again
    assert not ask(0.4, 3).info["cache_hit"]  # another scale: another key
