"""End to end through a real tritonserver with tritonclient: parity with stock Diffusers, endpoints, HTTP."""

import base64
import io
import json
import urllib.request
from concurrent.futures import wait

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from diffusers import FluxFillPipeline
from PIL import Image

from maskedit import imaging, samples
from maskedit.repository import PASSTHROUGH, PREPARED
from tests.conftest import png


@pytest.fixture(scope="module")
def stock(settings):
    return FluxFillPipeline.from_pretrained(settings.model_dir)


def test_health_metadata_config_over_grpc_and_http(server):
    g = grpcclient.InferenceServerClient(server.grpc_url)
    h = httpclient.InferenceServerClient(server.http_url)
    try:
        assert g.is_server_live() and g.is_server_ready() and h.is_server_live() and h.is_server_ready()
        for model in ("edit", "intake", "preprocess", "masked_denoise", "vae_decode"):
            assert g.is_model_ready(model) and h.is_model_ready(model)
        # no batcher in front of pre-processing (its 0.5 s re-poll paced a flood): the served config says so
        assert "dynamic_batching" not in h.get_model_config("preprocess")
        steps = g.get_model_config("edit", as_json=True)["config"]["ensemble_scheduling"]["step"]
        assert [s["model_name"] for s in steps][:2] == ["intake", "preprocess"]
        meta = g.get_model_metadata("edit", as_json=True)
        assert [i["name"] for i in meta["inputs"]][:3] == ["TEMPLATE", "MASK", "PROMPT"]
        assert {o["name"] for o in h.get_model_metadata("edit")["outputs"]} == {"IMAGE", "EDIT_INFO"}
        cfg = h.get_model_config("masked_denoise")
        assert cfg["model_transaction_policy"]["decoupled"] is True
        assert g.get_model_config("edit", as_json=True)["config"]["platform"] == "ensemble"
        assert g.get_server_metadata().version == "2.51.0"
    finally:
        g.close()
        h.close()


def test_repository_loads_cleanly(server):
    log = server.log_path.read_text(errors="replace").lower()
    for bad in ("no such file", "failed to load", "missing", "traceback", "modulenotfounderror"):
        assert bad not in log, f"server log mentions {bad!r}"


def test_starting_a_running_server_again_starts_no_second_one(server):
    pid = server.proc.pid
    assert server.start() is server and server.proc.pid == pid  # `with TritonServer(...).start()` stays single


def test_served_image_equals_stock_flux_fill(client, stock, settings, template_img, box_mask):
    r = client.edit(template_img, box_mask, "a red hat", seed=11, steps=4, guidance=20.0, raw_output=True,
                    template_seed=11, use_cache=False)
    ref = stock(prompt="a red hat", image=template_img, mask_image=Image.fromarray(box_mask), height=256,
                width=256, num_inference_steps=4, guidance_scale=20.0, max_sequence_length=settings.max_sequence_length,
                generator=torch.Generator("cpu").manual_seed(11)).images[0]
    served = np.asarray(r.image).astype(int)
    assert np.abs(served - np.asarray(ref).astype(int)).max() <= 1  # PNG of the same latents (see next test)
    assert (served == np.asarray(ref)).mean() > 0.999


def test_served_latents_equal_stock_within_1e4(server, stock, settings, template_img, box_mask):
    """Call the stages one by one over gRPC and compare the denoiser's output latents with stock Diffusers."""
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        ins = []
        for name, value, dtype in [("TEMPLATE", png(template_img), "BYTES"), ("MASK", png(box_mask), "BYTES"),
                                   ("PROMPT", b"a red hat", "BYTES")]:
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=np.object_))
            ins.append(t)
        for name, value, dtype, np_t in [("SEED", 11, "INT64", np.int64), ("TEMPLATE_SEED", 11, "INT64", np.int64),
                                         ("STEPS", 4, "INT32", np.int32), ("GUIDANCE", 20.0, "FP32", np.float32),
                                         ("USE_CACHE", False, "BOOL", np.bool_)]:
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=np_t))
            ins.append(t)
        pre = g.infer("preprocess", ins)
        names = [t.name for t in (*PREPARED, *PASSTHROUGH)]  # what the ensemble hands masked_denoise
        den_in = []
        for n in names:
            a = pre.as_numpy(n)
            t = grpcclient.InferInput(n, list(a.shape), grpcclient.np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(a)
            den_in.append(t)
        results = []
        g.start_stream(callback=lambda result, error: results.append((result, error)))
        g.async_stream_infer("masked_denoise", den_in, request_id="p1")
        g.stop_stream()  # waits for the stream to drain
        (res, err), = results
        assert err is None
        served = res.as_numpy("DENOISED")
    finally:
        g.close()
    ref = stock(prompt="a red hat", image=template_img, mask_image=Image.fromarray(box_mask), height=256, width=256,
                num_inference_steps=4, guidance_scale=20.0, max_sequence_length=settings.max_sequence_length,
                generator=torch.Generator("cpu").manual_seed(11), output_type="latent").images[0].numpy()
    np.testing.assert_allclose(served, ref, atol=1e-4, rtol=0)


def test_same_inputs_same_image_and_template_size_kept(client):
    tpl = samples.template(300, 200, seed=4)
    m = samples.mask(300, 200, 0.15, "box", seed=4)
    a = client.edit(tpl, m, "a yellow hat", seed=9, steps=3)
    b = client.edit(tpl, m, "a yellow hat", seed=9, steps=3)
    assert a.png == b.png
    out = np.asarray(a.image)
    assert out.shape == (200, 300, 3)
    far = imaging.soft_mask(m, 2 * 4 + 2) == 0  # beyond the feather
    assert np.array_equal(out[far], np.asarray(tpl)[far]), "pixels outside the mask must be the template's"
    assert not np.array_equal(out[m > 0], np.asarray(tpl)[m > 0]), "the masked region must change"
    assert a.info["model_size"] == [320, 208] and 0 < a.info["mask_ratio"] < 0.5
    # its steps' wall time and the denoise loop's CPU in them (docs/api.md), within its time in the loop
    assert 0 < a.info["steps_wall_s"] <= a.info["denoise_s"] + 1e-5 and a.info["steps_cpu_s"] > 0


def test_concurrent_requests_on_one_stream_come_back_to_their_callers(client, template_img, box_mask):
    """Concurrent requests share the running batch (batched floats may differ in the last bit from solo runs)."""
    kw = dict(steps=2, use_cache=False, raw_output=True)
    seq = {s: np.asarray(client.edit(template_img, box_mask, "a hat", seed=s, **kw).image, int) for s in range(3)}
    futs = {s: client.submit(template_img, box_mask, "a hat", seed=s, **kw) for s in range(3)}
    wait(futs.values(), timeout=120)
    for s, f in futs.items():
        got = np.asarray(f.result().image, int)
        assert np.abs(got - seq[s]).max() <= 2
        assert all(np.abs(got - seq[o]).max() > 2 for o in seq if o != s)


def _post(server, path, body):
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_generate_with_base64_images(server, client, template_img, box_mask):
    body = {"TEMPLATE": base64.b64encode(png(template_img)).decode(), "MASK": base64.b64encode(png(box_mask)).decode(),
            "PROMPT": "a red hat", "SEED": 5, "STEPS": 3}
    status, text = _post(server, "/v2/models/edit/generate", body)
    assert status == 200, text
    out = json.loads(text)
    grpc_png = client.edit(template_img, box_mask, "a red hat", seed=5, steps=3).png
    assert base64.b64decode(out["IMAGE"]) == grpc_png
    assert json.loads(out["EDIT_INFO"])["base64"] is True
    status, text = _post(server, "/v2/models/edit/generate_stream", body)
    assert status == 200 and text.startswith("data: ")
    assert base64.b64decode(json.loads(text[len("data: "):].strip())["IMAGE"]) == grpc_png
    status, text = _post(server, "/v2/models/edit/generate", {**body, "PROMPT": ""})
    assert status == 400 and "PROMPT" in json.loads(text)["error"]


def test_the_diffusers_parameters_through_triton(server, client, stock, settings, template_img, box_mask):
    """STRENGTH equals stock Flux Fill through the ensemble; PADDING_MASK_CROP and OUTPUT_FORMAT give what the
    stages in one process give (their parity with stock: tests/unit/maskedit/test_stock_parameters.py); the HTTP
    generate endpoint carries them and a bad value is a 400 naming it."""
    from maskedit.local import LocalEditor

    r = client.edit(template_img, box_mask, "a red hat", seed=11, steps=10, guidance=20.0, raw_output=True,
                    template_seed=11, use_cache=False, strength=0.45)
    ref = stock(prompt="a red hat", image=template_img, mask_image=Image.fromarray(box_mask), height=256,
                width=256, num_inference_steps=10, guidance_scale=20.0, strength=0.45,
                max_sequence_length=settings.max_sequence_length,
                generator=torch.Generator("cpu").manual_seed(11)).images[0]
    assert np.abs(np.asarray(r.image).astype(int) - np.asarray(ref).astype(int)).max() <= 1
    assert (r.info["strength"], r.info["first_step"], r.info["crop"]) == (0.45, 5, None)
    big, mask = samples.template(512, 512, seed=4), np.zeros((512, 512), np.uint8)
    mask[200:260, 300:380] = 255
    kw = dict(seed=3, steps=3, use_cache=False, padding_mask_crop=16)
    got = client.edit(big, mask, "a hat", **kw)
    assert got.info["crop"] is not None
    ed = LocalEditor(settings)
    try:
        local = np.asarray(Image.open(io.BytesIO(ed.edit(png(big), png(mask), "a hat", **kw)[0])), int)
    finally:
        ed.close()
    served = np.asarray(got.image, int)
    assert np.abs(served - local).max() <= 1 and (served == local).mean() > 0.999  # as the test above
    webp = client.edit(big, mask, "a hat", output_format="webp", output_quality=90, **kw)
    assert webp.png.startswith(b"RIFF") and webp.info["output_format"] == "webp"
    body = {"TEMPLATE": base64.b64encode(png(template_img)).decode(), "MASK": base64.b64encode(png(box_mask)).decode(),
            "PROMPT": "a red hat", "SEED": 5, "STEPS": 4, "STRENGTH": 0.5, "OUTPUT_FORMAT": "jpeg"}
    status, text = _post(server, "/v2/models/edit/generate", body)
    assert status == 200, text
    assert base64.b64decode(json.loads(text)["IMAGE"]).startswith(b"\xff\xd8\xff")
    status, text = _post(server, "/v2/models/edit/generate", {**body, "STRENGTH": 0.0})
    assert status == 400 and "STRENGTH" in json.loads(text)["error"]
    status, text = _post(server, "/v2/models/edit/generate", {**body, "OUTPUT_FORMAT": "gif"})
    assert status == 400 and "OUTPUT_FORMAT" in json.loads(text)["error"]
