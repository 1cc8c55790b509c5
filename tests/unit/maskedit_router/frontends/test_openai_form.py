"""The OpenAI form's rules (mask convention, fields, errors) without a server."""

import io

import numpy as np
import pytest
from PIL import Image

from maskedit_client import EditError
from maskedit_router.frontends.openai_errors import from_edit_error
from maskedit_router.frontends.openai_form import ApiError, edit_mask, parse
from tests.conftest import png

TPL = png(np.full((64, 96, 3), 120, np.uint8))


def _gray(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("L"))


def _form(**kw):
    form = {"image": TPL, "mask": png(np.zeros((64, 96), np.uint8)), "prompt": "a hat"}
    form.update(kw)
    return {k: v for k, v in form.items() if v is not None}


def test_transparent_pixels_of_an_rgba_mask_are_the_edit_area():
    rgba = np.zeros((64, 96, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[10:20, 30:50, 3] = 0  # OpenAI: transparent = edit, whatever the colour
    rgba[..., :3] = 255  # all white: under our own rule this would edit everything
    out = _gray(edit_mask(png(rgba), TPL))
    assert (out[10:20, 30:50] == 255).all() and out.sum() == 255 * 10 * 20


def test_masks_without_transparency_are_sent_unchanged():
    gray = np.zeros((64, 96), np.uint8)
    gray[5:9, 5:9] = 255
    opaque = np.dstack([np.dstack([gray] * 3), np.full((64, 96), 255, np.uint8)])  # RGBA, all opaque
    for m in (png(gray), png(opaque)):
        assert edit_mask(m, TPL) == m


def test_without_a_mask_the_images_transparent_pixels_are_edited_else_mask_is_required():
    rgba = np.full((64, 96, 4), 200, np.uint8)
    rgba[..., 3] = 255
    rgba[0:8, 0:8, 3] = 0
    assert _gray(edit_mask(None, png(rgba)))[0:8, 0:8].min() == 255
    with pytest.raises(ApiError) as e:
        edit_mask(None, TPL)
    assert e.value.param == "mask" and e.value.status == 400


def test_n_seeds_and_extras():
    job = parse(_form(n="3", seed="7", steps="4", guidance="12.5", template_seed="2", deadline_ms="900",
                      use_cache="false", user="u1", quality="high", negative_prompt="blurry"), ["edit"])
    assert job.seeds() == [7, 8, 9] and job.steps == 4 and job.guidance == 12.5 and job.template_seed == 2
    assert job.deadline_ms == 900 and job.use_cache is False and job.ignored == ["quality"]
    assert job.negative_prompt == "blurry" and parse(_form(), ["edit"]).negative_prompt is None
    assert parse(_form(), ["edit"]).seeds() == [None]  # one edit: the server's default seed


def test_the_diffusers_parameters_and_the_output_format_are_read():
    job = parse(_form(strength="0.6", padding_mask_crop="32", guidance_rescale="0.7", true_cfg_scale="4",
                      output_format="webp", output_compression="80"), ["edit"])
    assert (job.strength, job.padding_mask_crop, job.guidance_rescale, job.true_cfg_scale) == (0.6, 32, 0.7, 4.0)
    assert (job.output_format, job.output_quality) == ("webp", 80)
    plain = parse(_form(), ["edit"])
    assert plain.strength is None and plain.output_format is None and plain.output_quality is None


@pytest.mark.parametrize("change,param,status", [
    (dict(image=None), "image", 400), (dict(prompt=None), "prompt", 400), (dict(n="0"), "n", 400),
    (dict(n="x"), "n", 400), (dict(size="10x10"), "size", 400), (dict(size="200x100"), "size", 400),
    (dict(response_format="url"), "response_format", 400), (dict(model="dall-e-2"), "model", 404),
    (dict(stream="true"), "stream", 400), (dict(eta="1"), "eta", 400), (dict(strength="x"), "strength", 400),
    (dict(output_compression="101"), "output_compression", 400),
    (dict(output_compression="50", output_quality="50"), "output_compression", 400),
    (dict(seed="-1", n="1"), None, None),  # passes the form: the server says the limit
])
def test_form_errors_name_the_field(change, param, status):
    if param is None:
        parse(_form(**change), ["edit"])
        return
    with pytest.raises(ApiError) as e:
        parse(_form(**change), ["edit"])
    assert e.value.param == param and e.value.status == status and e.value.message.startswith(param + ": ")
    body = e.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_size_that_keeps_the_aspect_ratio_resizes():
    assert parse(_form(size="192x128"), ["edit"]).size == (192, 128)
    assert parse(_form(size="96x64"), ["edit"]).size is None  # the template's own
    assert parse(_form(size="auto"), ["edit"]).size is None


@pytest.mark.parametrize("message,status,param,text", [
    ("in ensemble 'edit', INVALID_ARGUMENT: STEPS: must be between 1 and 100, got 0", 400, "steps",
     "steps: must be between 1 and 100, got 0"),
    ("INVALID_ARGUMENT: TEMPLATE: could not decode image (x)", 400, "image", "image: could not decode image (x)"),
    ("UNAVAILABLE: RESOURCE_EXHAUSTED: denoise queue is full (4 waiting); retry later", 429, None,
     "denoise queue is full (4 waiting); retry later"),
    ("RESOURCE_EXHAUSTED: router has 256 requests in flight", 429, None, "router has 256 requests in flight"),
    ("UNAVAILABLE: no healthy backend", 503, None, "no healthy backend"),
    ("UNAVAILABLE: DEADLINE_EXCEEDED: cannot finish within 1 ms", 504, None, "cannot finish within 1 ms"),
])
def test_service_errors_map_to_http_status_and_param(message, status, param, text):
    e = EditError.from_server(message)
    api = from_edit_error(e.code, e.field, str(e))
    assert (api.status, api.param, api.message) == (status, param, text)


def test_controls_come_as_json_with_files_or_with_base64_images_inside():
    import base64
    import json

    from maskedit_common.controls import ControlSpec

    a, b = png(np.zeros((32, 32, 3), np.uint8)), png(np.full((32, 32, 3), 255, np.uint8))
    specs = [{"name": "canny", "scale": 0.8}, {"name": "union", "mode": "depth", "start": 0.2, "end": 0.9}]
    job = parse(_form(controls=json.dumps(specs), **{"control_image[]": [a, b]}), ["edit"])
    assert job.controls == (ControlSpec("canny", 0.8), ControlSpec("union", 1.0, 0.2, 0.9, "depth"))
    assert job.control_images == [a, b]
    inline = [{**specs[0], "image": base64.b64encode(a).decode()}, {**specs[1], "image": base64.b64encode(b).decode()}]
    job = parse(_form(controls=json.dumps(inline)), ["edit"])  # the OpenAI SDK's extra_body can carry text only
    assert job.controls[1].mode == "depth" and job.control_images == [base64.b64encode(x) for x in (a, b)]
    assert parse(_form(), ["edit"]).controls == ()


@pytest.mark.parametrize("change,param", [
    (dict(controls="[", control_image=TPL), "controls"),
    (dict(controls='[{"name": "a", "scale": -1}]', control_image=TPL), "controls"),
    (dict(control_image=TPL), "control_image"),
])
def test_control_errors_name_the_form_field(change, param):
    with pytest.raises(ApiError) as e:
        parse(_form(**change), ["edit"])
    assert e.value.param == param and e.value.status == 400


def test_images_after_the_first_are_reference_images():
    """``image[]`` with several images (as the OpenAI SDK sends a list): the first is the template, the rest the
    in-context edit model's reference images; the server's errors about them name ``image``."""
    from maskedit_router.frontends.openai_form import PARAM_OF_TENSOR

    a, b = png(np.zeros((32, 32, 3), np.uint8)), png(np.full((32, 32, 3), 255, np.uint8))
    job = parse(_form(image=None, **{"image[]": [TPL, a, b]}), ["edit"])
    assert job.image == TPL and job.reference_images == [a, b]
    assert parse(_form(), ["edit"]).reference_images == []
    assert PARAM_OF_TENSOR["REFERENCE_IMAGES"] == "image"


def _as_openai_sends(extra: dict) -> dict:
    """``extra_body`` as the openai package puts it into a multipart form (its own serializer), read back as the
    endpoint's ``read_form`` reads it: a field sent more than once as a list of its values."""
    import openai

    client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="-")
    try:
        return client._serialize_multipartform(extra)
    finally:
        client.close()


def test_the_openai_packages_own_encoding_of_nested_extra_body_fields():
    import base64

    from maskedit_common.controls import ControlSpec
    from maskedit_common.loras import LoraRef

    one = _as_openai_sends({"lora": {"name": "attn-r4", "scale": 0.8}})
    assert set(one) == {"lora[name]", "lora[scale]"}  # what a JSON-string-only endpoint refused
    assert parse(_form(**one), ["edit"]).lora == (LoraRef("attn-r4", 0.8),)
    several = _as_openai_sends({"lora": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": -0.25}]})
    assert parse(_form(**several), ["edit"]).lora == (LoraRef("a", 0.5), LoraRef("b", -0.25))
    names = _as_openai_sends({"lora": ["a", "b"]})
    assert parse(_form(**names), ["edit"]).lora == (LoraRef("a", 1.0), LoraRef("b", 1.0))
    a, b = png(np.zeros((32, 32, 3), np.uint8)), png(np.full((32, 32, 3), 255, np.uint8))
    controls = [{"name": "canny", "scale": 0.8, "start": 0.0, "end": 1.0, "image": base64.b64encode(a).decode()},
                {"name": "union", "scale": 1.0, "start": 0.2, "end": 0.9, "image": base64.b64encode(b).decode()}]
    job = parse(_form(**_as_openai_sends({"controls": controls})), ["edit"])
    assert job.controls == (ControlSpec("canny", 0.8), ControlSpec("union", 1.0, 0.2, 0.9))
    assert job.control_images == [base64.b64encode(x) for x in (a, b)]


def test_temporal_from_the_openai_package_goes_on_as_json_text():
    import json

    from maskedit_common.temporal import parse as parse_temporal

    for spec in ({"policy": "fbcache", "threshold": 0.08}, {"policy": "dbcache", "threshold": 0.1, "fn": 1, "bn": 0},
                 {"policy": "steps", "steps": [0, 2, 5]}):
        job = parse(_form(**_as_openai_sends({"temporal": spec})), ["edit"])
        assert json.loads(job.temporal) == spec  # numbers as numbers, the list as a list
        parse_temporal(job.temporal, 8)  # what the server reads it with
    assert parse(_form(temporal='{"policy": "off"}'), ["edit"]).temporal == '{"policy": "off"}'  # text: unchanged


def test_numbered_form_fields_and_their_errors():
    from maskedit_common.controls import ControlSpec
    from maskedit_common.loras import LoraRef

    numbered = {"controls[1][name]": "depth", "controls[0][name]": "canny", "controls[1][start]": "0.5",
                "control_image[]": [TPL, TPL]}
    job = parse(_form(**numbered), ["edit"])  # entries in index order; keys may differ between entries
    assert job.controls == (ControlSpec("canny"), ControlSpec("depth", 1.0, 0.5)) and len(job.control_images) == 2
    assert parse(_form(**{"lora[0][name]": "x", "lora[0][scale]": "2"}), ["edit"]).lora == (LoraRef("x", 2.0),)
    bad_cases = [
        ({"controls[][name]": ["canny", "depth"], "controls[][scale]": "0.5"}, "controls[][scale] has 1 values"),
        ({"lora": '{"name": "a"}', "lora[name]": "b"}, "send it one way"),
        ({"lora[name]": "a", "lora[scale]": "high"}, "scale must be a number"),
        ({"lora[0][x][y]": "a"}, "nest too deep"),
        ({"prompt": ["a", "b"]}, "prompt: is given 2 times"),
    ]
    for fields, text in bad_cases:
        with pytest.raises(ApiError) as e:
            parse(_form(**fields), ["edit"])
        assert e.value.status == 400 and text in e.value.message, (fields, e.value.message)
        assert e.value.param == next(iter(fields)).split("[")[0]
