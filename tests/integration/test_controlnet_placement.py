"""ControlNets placed in their own Triton model (``MASKEDIT_CONTROLNET_PLACEMENT=triton``): masked_denoise gets the
residuals through BLS from the ``controlnet`` model. One server (placement is a server setting): its images equal
the in-process path's (``LocalEditor``, the same model) for one and two ControlNets; a request whose ControlNet the
controlnet model cannot run fails alone, naming CONTROLS, while a request without controls sent with it
succeeds; the metrics port counts the BLS calls."""

import io
import shutil
import threading
import urllib.request

import numpy as np
import pytest
from PIL import Image

from maskedit import samples
from maskedit.families import family_for
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit.launcher import TritonServer
from maskedit.local import LocalEditor
from maskedit.settings import load_settings
from maskedit_client import EditClient, EditError
from tests.conftest import png

CONTROLS = [{"name": "canny", "scale": 0.8}, {"name": "union", "scale": 0.5, "mode": "depth", "start": 0.3}]


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    d = tmp_path_factory.mktemp("cn-placed")
    model = build_unet(d / "model", "sdxl-tiny")
    family_for(model).build_controlnets(model / "controlnets")
    broken = model / "controlnets" / "broken"  # a valid config (admitted) with weights the controlnet model cannot load
    shutil.copytree(model / "controlnets" / "canny", broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    server = TritonServer(log_path=d / "tritonserver.log", env={
        "MASKEDIT_MODEL_DIR": str(model), "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"),
        "MASKEDIT_CACHE_DISK_DIR": str(d / "disk"), "MASKEDIT_CONTROLNET_PLACEMENT": "triton"})
    server.start()
    client = EditClient(server.grpc_url)
    try:
        yield model, client, server
    finally:
        client.close()
        server.stop()


def test_bls_images_equal_the_in_process_path_for_one_and_two_controlnets(placed, template_img, box_mask):
    model, client, _ = placed
    ctl = [samples.template(256, 256, seed=41), samples.template(192, 320, seed=42)]
    local = LocalEditor(load_settings({"MASKEDIT_MODEL_DIR": str(model)}))
    try:
        for n in (1, 2):
            r = client.edit(template_img, box_mask, "a red hat", seed=11, steps=3, guidance=7.5, raw_output=True,
                            template_seed=11, controls=CONTROLS[:n], control_images=ctl[:n])
            assert r.info["control_placement"] == "triton" and r.info["control_bls_s"] >= r.info["control_model_s"] > 0
            ref, _, _ = local.edit(png(template_img), png(box_mask), "a red hat", seed=11, steps=3, guidance=7.5,
                                   raw_output=True, template_seed=11, controls=CONTROLS[:n],
                                   control_images=[png(c) for c in ctl[:n]])
            served = np.asarray(r.image).astype(int)
            assert np.abs(served - np.asarray(Image.open(io.BytesIO(ref))).astype(int)).max() <= 1
    finally:
        local.close()


def test_a_failing_controlnet_call_fails_only_its_request(placed, template_img, box_mask):
    model, client, server = placed
    results = {}

    def send(key, **kw):
        try:
            results[key] = client.edit(template_img, box_mask, "a hat", seed=3, steps=3, **kw)
        except EditError as e:
            results[key] = e
    threads = [threading.Thread(target=send, args=("plain",)),
               threading.Thread(target=send, args=("broken",), kwargs=dict(
                   controls=[{"name": "broken"}], control_images=[samples.template(64, 64, seed=5)]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not isinstance(results["plain"], EditError) and results["plain"].image.size == template_img.size
    err = results["broken"]
    assert isinstance(err, EditError) and err.code == "INTERNAL"  # not UNAVAILABLE: clients do not retry it
    assert "CONTROLS: the controlnet model failed for ControlNet 'broken'" in str(err)
    assert "could not be loaded (OSError)" in str(err)
    assert "/" not in str(err).split("could not be loaded")[1]  # no server paths
    ok = client.edit(template_img, box_mask, "a hat", seed=3, steps=2, controls=CONTROLS[:1],
                     control_images=[samples.template(64, 64, seed=5)])  # the server keeps serving controls
    assert ok.info["control_bls_s"] > 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'maskedit_controlnet_failures_total{placement="triton"} 1' in text
    assert 'maskedit_controlnet_bls_calls_total{placement="triton"}' in text
