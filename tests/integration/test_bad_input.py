"""Each malformed request gets a clear INVALID_ARGUMENT naming the field, and the server keeps serving."""

import io

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image

from maskedit_client import EditError
from tests.conftest import png


@pytest.fixture
def good(client, template_img, box_mask):
    """Run a good request after every bad one: the server must still answer correctly."""
    yield
    r = client.edit(template_img, box_mask, "a hat", seed=1, steps=2)
    assert r.image.size == template_img.size


def _err(client, *args, **kw) -> EditError:
    with pytest.raises(EditError) as e:
        client.edit(*args, **kw)
    return e.value


CASES = {
    "not_an_image": (dict(template=b"definitely not an image"), "TEMPLATE", "could not decode"),
    "truncated_png": ("truncated", "TEMPLATE", "could not decode"),
    "mask_other_aspect": (dict(mask=np.zeros((100, 300), np.uint8)), "MASK", "aspect ratio"),
    "empty_prompt": (dict(prompt=""), "PROMPT", "is empty"),
    "over_long_prompt": (dict(prompt="hat " * 600), "PROMPT", "above the limit"),
    "over_long_prompt_tokens": (dict(prompt="a red hat with yellow flowers " * 12), "PROMPT", "tokens long"),
    "negative_prompt_on_flux": (dict(negative_prompt="blurry"), "NEGATIVE_PROMPT", "not used by Flux"),
    "steps_zero": (dict(steps=0), "STEPS", "between 1 and"),
    "steps_too_many": (dict(steps=1000), "STEPS", "between 1 and"),
    "guidance_negative": (dict(guidance=-1.0), "GUIDANCE", "between 0 and"),
    "guidance_nan": (dict(guidance=float("nan")), "GUIDANCE", "between 0 and"),
    "too_many_pixels": ("huge", "TEMPLATE", "above the limit"),
}


def bad_args(case: str, template_img, box_mask) -> tuple[dict, str, str]:
    """The edit arguments of bad-input ``case``, the field it must be refused for, and a text the error holds."""
    change, field, text = CASES[case]
    args = dict(template=png(template_img), mask=png(box_mask), prompt="a hat", steps=2)
    if change == "truncated":
        args["template"] = args["template"][:-200]
    elif change == "huge":
        args["template"] = png(np.zeros((4100, 4100, 3), np.uint8))
        args["mask"] = png(np.zeros((4100, 4100), np.uint8))
    else:
        args.update(change)
    return args, field, text


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_names_the_field(case, client, template_img, box_mask, good):
    args, field, text = bad_args(case, template_img, box_mask)
    e = _err(client, **args)
    assert e.code == "INVALID_ARGUMENT" and e.field == field and text in str(e), str(e)


def _raw_inputs(template_img, box_mask, drop=(), override=None):
    ins = []
    for name, value in [("TEMPLATE", png(template_img)), ("MASK", png(box_mask)), ("PROMPT", b"a hat")]:
        if name in drop:
            continue
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value], dtype=np.object_))
        ins.append(t)
    return ins + (override or [])


def test_missing_required_tensor(client, template_img, box_mask, good):
    with pytest.raises(EditError, match="missing required input.*TEMPLATE") as e:
        client.submit_inputs(_raw_inputs(template_img, box_mask, drop=("TEMPLATE",))).result(60)
    assert e.value.code == "INVALID_ARGUMENT"


def test_wrong_dtype(client, template_img, box_mask, good):
    t = grpcclient.InferInput("STEPS", [1], "FP32")
    t.set_data_from_numpy(np.array([4.0], np.float32))
    with pytest.raises(EditError, match="STEPS") as e:
        client.submit_inputs(_raw_inputs(template_img, box_mask, override=[t])).result(60)
    assert "INT32" in str(e.value) and e.value.code == "INVALID_ARGUMENT"


def test_wrong_shape(client, template_img, box_mask, good):
    t = grpcclient.InferInput("SEED", [2], "INT64")
    t.set_data_from_numpy(np.array([1, 2], np.int64))
    with pytest.raises(EditError, match="SEED") as e:
        client.submit_inputs(_raw_inputs(template_img, box_mask, override=[t])).result(60)
    assert e.value.code == "INVALID_ARGUMENT"


def test_mask_of_other_size_same_aspect_is_resized(client, template_img, box_mask, good):
    small = np.asarray(Image.fromarray(box_mask).resize((128, 128), Image.NEAREST))
    a = client.edit(template_img, small, "a hat", seed=3, steps=2)
    b = client.edit(template_img, box_mask, "a hat", seed=3, steps=2)
    assert a.png == b.png


def test_non_binary_mask_is_thresholded_at_128(client, template_img, box_mask, good):
    gray = np.where(box_mask > 0, 200, 100).astype(np.uint8)  # 200 -> edit, 100 -> keep
    a = client.edit(template_img, gray, "a hat", seed=3, steps=2)
    b = client.edit(template_img, box_mask, "a hat", seed=3, steps=2)
    assert a.png == b.png


def test_empty_mask_returns_the_template(client, template_img, good):
    r = client.edit(template_img, np.zeros((256, 256), np.uint8), "a hat")
    assert np.array_equal(np.asarray(r.image), np.asarray(template_img))
    assert r.info["empty_mask"] and r.info["denoise_s"] == 0.0


def test_full_mask_edits_everything(client, template_img, good):
    r = client.edit(template_img, np.full((256, 256), 255, np.uint8), "a hat", steps=2)
    assert r.info["mask_ratio"] == 1.0
    assert np.abs(np.asarray(r.image).astype(int) - np.asarray(template_img)).mean() > 5


def test_jpeg_and_webp_templates(client, template_img, box_mask, good):
    for fmt in ("JPEG", "WEBP"):
        buf = io.BytesIO()
        template_img.save(buf, format=fmt)
        r = client.edit(buf.getvalue(), box_mask, "a hat", steps=2)
        assert r.image.size == template_img.size
