"""The OpenAI-compatible API of the router, driven by the official ``openai`` package against a real router in
front of a real tritonserver."""

import base64
import io
import json
import time

import numpy as np
import openai
import pytest
from PIL import Image, ImageFilter

from maskedit import samples
from maskedit.launcher import free_port
from maskedit_lab.harness.cluster import running_cluster
from tests.conftest import png
from tests.integration.test_bad_input import CASES, bad_args

MARGIN = 12  # px: the edit is feathered (grown 4 px, blurred) at the model size and resized back; beyond, the template


@pytest.fixture(scope="module")
def api(settings, tmp_path_factory):
    port = free_port()
    with running_cluster(1, tmp_path_factory.mktemp("openai"), openai_port=port,
                         env={"MASKEDIT_MODEL_DIR": str(settings.model_dir)}) as (router, url, servers):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield {"client": client, "router": router, "port": port}
        client.close()


def _png_file(a, name="image.png"):
    return (name, png(a), "image/png")


def _image(item) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))))


def _outside(mask: np.ndarray) -> np.ndarray:
    """Pixels at least MARGIN px away from the edited area."""
    grown = np.asarray(Image.fromarray(mask).filter(ImageFilter.MaxFilter(2 * MARGIN + 1)))
    return grown == 0


def test_models_lists_the_edit_model(api, settings):
    from maskedit_common.controls import library_names as controlnet_names
    from maskedit_common.loras import library_names

    models = api["client"].models.list().data
    assert models[0].id == "edit"  # then the adapter and ControlNet libraries', each with the base model as parent
    assert {m.id: m.model_extra.get("type") for m in models[1:]} == {
        **{n: "lora" for n in library_names(settings.adapters)},
        **{n: "controlnet" for n in controlnet_names(settings.controlnets)}}
    with pytest.raises(openai.NotFoundError) as e:
        api["client"].models.retrieve("dall-e-2")
    assert e.value.body["param"] == "model"


def test_edit_returns_a_png_of_the_template_size_changed_only_inside_the_mask(api):
    tpl = samples.template(320, 192, seed=3)  # not square: the size must come back as the template's
    mask = np.zeros((192, 320), np.uint8)
    mask[48:144, 96:224] = 255
    r = api["client"].images.edit(image=_png_file(tpl), mask=_png_file(mask, "mask.png"), prompt="a red hat",
                                  response_format="b64_json", extra_body={"seed": 5, "steps": 3})
    assert len(r.data) == 1
    raw = base64.b64decode(r.data[0].b64_json)
    assert raw.startswith(b"\x89PNG")
    out, src = _image(r.data[0]), np.asarray(tpl)
    assert out.shape == src.shape
    inside = mask > 0
    assert np.abs(out[inside].astype(int) - src[inside]).mean() > 5  # the masked area changed
    outside = _outside(mask)
    assert np.array_equal(out[outside], src[outside])  # the rest is the template's own pixels
    info = r.data[0].model_extra["edit_info"]  # our extra field, kept by the openai package
    assert info["seed"] == 5 and info["steps"] == 3


def test_openai_transparent_mask_means_the_same_edit_as_a_white_mask(api):
    """OpenAI marks the edit area by transparent mask pixels; ours by white ones: same area, same image."""
    tpl = samples.template(256, 256, seed=4)
    white = np.zeros((256, 256), np.uint8)
    white[64:160, 32:128] = 255
    rgba = np.zeros((256, 256, 4), np.uint8)
    rgba[..., 3] = np.where(white > 0, 0, 255)  # transparent = edit
    rgba[..., :3] = 255  # colour does not matter under the OpenAI rule
    kw = dict(image=_png_file(tpl), prompt="a lake", extra_body={"seed": 9, "steps": 2, "use_cache": "false"})
    a = api["client"].images.edit(mask=_png_file(white, "m.png"), **kw)
    b = api["client"].images.edit(mask=_png_file(rgba, "m.png"), **kw)
    assert a.data[0].b64_json == b.data[0].b64_json
    # No mask at all: the image's own transparent pixels are the area to edit (OpenAI's rule)
    rgba_tpl = np.dstack([np.asarray(tpl), rgba[..., 3]])
    c = api["client"].images.edit(image=_png_file(rgba_tpl), prompt="a lake",
                                  extra_body={"seed": 9, "steps": 2, "use_cache": "false"})
    assert np.array_equal(_image(c.data[0]), _image(a.data[0]))


def test_n_edits_have_different_seeds_and_share_the_templates_cache(api):
    tpl = samples.template(256, 256, seed=21)
    mask = samples.mask(256, 256, 0.15, "box", seed=2)
    r = api["client"].images.edit(image=_png_file(tpl), mask=_png_file(mask, "m.png"), prompt="a hat", n=3,
                                  extra_body={"seed": 40, "steps": 3})
    infos = [d.model_extra["edit_info"] for d in r.data]
    assert [i["seed"] for i in infos] == [40, 41, 42]
    assert len({d.b64_json for d in r.data}) == 3  # three different edits
    assert len({i["cache_key"] for i in infos}) == 1 and len({i["instance"] for i in infos}) == 1
    # one of them records the template's activations; the others read them (live from that run or the store)
    assert sorted(i["cache"] for i in infos).count("hit") >= 2, [i["cache"] for i in infos]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_triton_apis_bad_inputs_are_400_naming_the_field(case, api, template_img, box_mask):
    args, field, text = bad_args(case, template_img, box_mask)
    extra = {k: str(args[k]) for k in ("steps", "guidance", "negative_prompt") if k in args}
    with pytest.raises(openai.BadRequestError) as e:
        api["client"].images.edit(image=("i.png", args["template"], "image/png"),
                                  mask=("m.png", png(args["mask"]) if isinstance(args["mask"], np.ndarray)
                                        else args["mask"], "image/png"),
                                  prompt=args["prompt"], extra_body=extra)
    param = {"TEMPLATE": "image", "MASK": "mask", "PROMPT": "prompt", "STEPS": "steps", "GUIDANCE": "guidance",
             "NEGATIVE_PROMPT": "negative_prompt"}
    err = e.value.body
    assert err["param"] == param[field] and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(param[field] + ": ") and text in err["message"], err
    assert "<" not in err["message"] and "object at" not in err["message"]  # no Python reprs


FORM_CASES = {
    "no_prompt": (dict(prompt=None), "prompt"),
    "url_format": (dict(response_format="url"), "response_format"),
    "n_zero": (dict(n=0), "n"),
    "n_too_many": (dict(n=11), "n"),
    "bad_size": (dict(size="big"), "size"),
    "size_other_aspect": (dict(size="512x256"), "size"),
    "seed_text": (dict(extra_body={"seed": "seven"}), "seed"),
    "unknown_field": (dict(extra_body={"eta": "0.5"}), "eta"),
    "strength_above_1": (dict(extra_body={"strength": "2"}), "strength"),  # the server's limit, named as the form's
    "output_format_gif": (dict(extra_body={"output_format": "gif"}), "output_format"),
    "opaque_image_without_mask": (dict(mask=None), "mask"),
    "deadline_zero": (dict(extra_body={"deadline_ms": "0"}), "deadline_ms"),
    "controls_not_json": (dict(extra_body={"controls": "["}), "controls"),
}


@pytest.mark.parametrize("case", sorted(FORM_CASES))
def test_form_errors_are_400_naming_the_field(case, api, template_img, box_mask):
    change, param = FORM_CASES[case]
    kw = dict(image=_png_file(template_img), mask=_png_file(box_mask, "m.png"), prompt="a hat",
              extra_body={"steps": 2})
    kw.update(change)
    kw = {k: v for k, v in kw.items() if v is not None}
    if "prompt" not in kw:  # the openai package requires it: send the form without it by hand
        kw["prompt"] = openai.omit
    with pytest.raises(openai.BadRequestError) as e:
        api["client"].images.edit(**kw)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param + ": "), e.value.body
    # and the server keeps serving
    assert api["client"].images.edit(image=_png_file(template_img), mask=_png_file(box_mask, "m.png"),
                                     prompt="a hat", extra_body={"steps": 1}).data


def test_controls_and_their_images_reach_the_server_through_the_router(api, template_img, box_mask):
    """CONTROLS and CONTROL_IMAGES (from base64 inside the controls) travel OpenAI -> router -> Triton: the server
    judges the ControlNet name, which it does only once each control has its image."""
    image = base64.b64encode(png(np.zeros((32, 32, 3), np.uint8))).decode()
    with pytest.raises(openai.BadRequestError) as e:
        api["client"].images.edit(image=_png_file(template_img), mask=_png_file(box_mask, "m.png"), prompt="a hat",
                                  extra_body={"steps": 1, "controls": json.dumps(
                                      [{"name": "no-such-controlnet", "scale": 0.5, "image": image}])})
    body = e.value.body
    assert body["param"] == "controls" and "unknown ControlNet 'no-such-controlnet'" in body["message"], body


def test_deadline_gives_504(api, template_img, box_mask):
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as e:
        api["client"].images.edit(image=_png_file(template_img), mask=_png_file(box_mask, "m.png"),
                                  prompt="a hat", extra_body={"steps": 100, "deadline_ms": 1, "use_cache": "false"})
    assert e.value.status_code == 504 and e.value.body["code"] == "deadline_exceeded", e.value.body
    assert time.perf_counter() - t0 < 30  # not after 100 steps (a loaded host's interpreter start and encode aside)


def test_full_router_gives_429_and_no_backend_gives_503_at_the_deadline(api, template_img, box_mask):
    router = api["router"]
    kw = dict(image=_png_file(template_img), mask=_png_file(box_mask, "m.png"), prompt="a hat",
              extra_body={"steps": 1})
    limit, router.max_inflight = router.max_inflight, 0  # the router's own in-flight limit: full
    try:
        with pytest.raises(openai.RateLimitError) as e:
            api["client"].images.edit(**kw)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full", e.value.body
    finally:
        router.max_inflight = limit
    backend = next(iter(router.backends.values()))
    # Its circuit breaker open and held open (the health checker's probe would close it once an edit succeeds):
    # no backend in rotation.
    backend.open_circuit()
    backend.succeeded = lambda: None
    try:
        # held while no backend is up (a restart costs latency, not errors), until the request's own deadline
        t0 = time.perf_counter()
        with pytest.raises(openai.InternalServerError) as e:
            api["client"].images.edit(**{**kw, "extra_body": {"steps": 1, "deadline_ms": 2000}})
        assert e.value.status_code == 503 and e.value.body["type"] == "server_error", e.value.body
        assert 1.5 < time.perf_counter() - t0 < 30  # at its 2 s deadline, not the 600 s timeout (load aside)
    finally:
        del backend.succeeded
        backend.succeeded()
    assert api["client"].images.edit(**kw).data  # serving again


def test_bodies_that_are_not_a_form_and_unknown_paths_get_openai_errors(api):
    import urllib.error
    import urllib.request

    def call(path, data=None, ctype="application/json"):
        req = urllib.request.Request(f"http://127.0.0.1:{api['port']}{path}", data=data,
                                     headers={"Content-Type": ctype})
        try:
            urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]
        raise AssertionError("expected an error")

    status, err = call("/v1/images/edits", b'{"prompt": "a hat"}')
    assert status == 400 and "multipart/form-data" in err["message"] and set(err) == {"message", "type", "param",
                                                                                        "code"}
    status, err = call("/v1/images/edits", b"--x\r\nnot a form", "multipart/form-data; boundary=x")
    assert status == 400, err
    status, err = call("/v1/nothing-here")
    assert status == 404 and err["type"] == "invalid_request_error"


def test_size_resizes_the_result(api, template_img, box_mask):
    r = api["client"].images.edit(image=_png_file(template_img), mask=_png_file(box_mask, "m.png"), prompt="a hat",
                                  size="128x128", extra_body={"steps": 1})
    assert _image(r.data[0]).shape == (128, 128, 3) and r.size == "128x128"


def test_the_diffusers_parameters_and_the_output_format_reach_the_server(api, template_img, box_mask):
    r = api["client"].images.edit(image=_png_file(template_img), mask=_png_file(box_mask, "m.png"), prompt="a hat",
                                  extra_body={"steps": 4, "strength": "0.5", "padding_mask_crop": "8",
                                              "output_format": "webp", "output_compression": "80"})
    info = r.data[0].model_extra["edit_info"]
    assert base64.b64decode(r.data[0].b64_json).startswith(b"RIFF") and r.output_format == "webp"
    assert (info["strength"], info["first_step"], info["output_quality"]) == (0.5, 2, 80) and info["crop"]
