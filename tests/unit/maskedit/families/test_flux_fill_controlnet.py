"""Our extension (no stock pipeline to compare with): Flux ControlNet residuals fed to the Flux Fill transformer
(``controlnet_block_samples``), through the stages in one process. Invariants: scale 0 equals the plain Fill edit bit
for bit; a ControlNet changes the edit; requests with and without controls through the engine equal each alone; a
ControlNet of other widths is refused by name."""

import numpy as np
import pytest

from maskedit.errors import InvalidInput
from maskedit.families.flux_controlnet.tiny import PRESETS, Net, controlnet
from maskedit.local import LocalEditor, run_job
from maskedit.settings import load_settings
from tests.conftest import png

from .cn_util import box_mask, concurrently, edges, engine_inputs, template


@pytest.fixture(scope="module")
def fill(settings, tmp_path_factory):
    lib = tmp_path_factory.mktemp("fill-controlnets")
    p = PRESETS["flux-cn-tiny"]  # the tiny Fill model's widths (latents 16, text 32, pooled 32, inner 32)
    controlnet(p, Net(1, 2), seed=1).save_pretrained(lib / "canny")
    controlnet(p, Net(1, 1, num_mode=7), seed=2).save_pretrained(lib / "union")
    wide = PRESETS["flux-cn-bench"]
    controlnet(wide, Net(1, 1), seed=3).save_pretrained(lib / "wide")
    s = load_settings({"MASKEDIT_MODEL_DIR": str(settings.model_dir), "MASKEDIT_DEVICE": "cpu",
                       "MASKEDIT_CONTROLNET_DIR": str(lib), "MASKEDIT_CACHE": "off"})
    ed = LocalEditor(s, max_batch=3)
    yield ed
    ed.close()


def latents(ed, controls=(), images=(), seed=3, steps=3, **kw):
    _, _, job = ed.edit(png(template(seed=1)), png(box_mask()), "a red hat", seed=seed, steps=steps, raw_output=True,
                        template_seed=seed, controls=list(controls), control_images=list(images), **kw)
    return job.result()


def test_scale_zero_equals_the_plain_fill_edit_and_a_controlnet_changes_it(fill):
    plain = latents(fill)
    assert np.array_equal(latents(fill, [{"name": "canny", "scale": 0.0}], [png(edges())]), plain)
    assert np.array_equal(latents(fill, [{"name": "union", "mode": "depth", "scale": 0.0}], [png(edges())]), plain)
    moved = latents(fill, [{"name": "canny", "scale": 1.0}], [png(edges())])
    assert np.abs(moved - plain).max() > 1e-2


def test_requests_with_and_without_controls_through_the_engine_equal_each_alone(fill):
    asks = [([], []), ([{"name": "canny", "scale": 0.7}], [png(edges(seed=4))]),
            ([{"name": "union", "mode": "canny", "end": 0.5}, {"name": "canny", "scale": 1.5}],
             [png(edges(seed=5)), png(edges(seed=6))])]
    inputs = engine_inputs(fill, template(seed=2), box_mask(), asks, seed=20, steps=3)
    alone = [run_job(fill.engine, x).result() for x in inputs]
    results = concurrently(fill.engine, inputs)
    for x, y in zip(results, alone):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


def test_a_controlnet_of_other_widths_is_refused_by_name(fill):
    with pytest.raises(InvalidInput) as e:
        latents(fill, [{"name": "wide"}], [png(edges())], steps=1)
    assert e.value.field == "CONTROLS" and "does not fit" in str(e.value)
    assert latents(fill, steps=1).shape[0] == 256  # and it keeps serving


def test_padding_mask_crop_crops_the_control_image_with_the_template(fill):
    """PADDING_MASK_CROP on our extension (no stock pipeline): the control image is cropped with the template's box
    and resized "fill" as the template is (as the SD / SDXL ControlNet inpaint pipelines crop theirs, so the
    control stays aligned with the crop); scale 0 still equals the plain cropped Fill edit bit for bit."""
    import json

    from maskedit.params import parse_params

    ctrl = edges(seed=8)
    params = parse_params(fill.settings, "a red hat", steps=1, padding_mask_crop=8,
                          controls=json.dumps([{"name": "canny"}]))
    p = fill.pre(png(template(seed=1)), png(box_mask()), params, [png(ctrl)])
    x1, y1, x2, y2 = p.crop
    assert x2 - x1 < 256 and y2 - y1 < 256  # a crop smaller than the template: it matters
    family, pipe, s = fill.pre.family, fill.pre.pipe, fill.settings
    cut = ctrl.crop(p.crop)  # cropped by hand: the same tensor as the box applied by pre-processing
    ref = family.prepare_control_image(pipe, cut, p.model_w, p.model_h, s, crop=(0, 0, *cut.size))
    np.testing.assert_array_equal(p.controls[0].image, ref.numpy())
    whole = family.prepare_control_image(pipe, ctrl, p.model_w, p.model_h, s)
    assert np.abs(p.controls[0].image - whole.numpy()).max() > 0.1
    plain = latents(fill, padding_mask_crop=8)
    assert np.array_equal(latents(fill, [{"name": "canny", "scale": 0.0}], [png(ctrl)], padding_mask_crop=8), plain)
    assert np.abs(latents(fill, [{"name": "canny"}], [png(ctrl)], padding_mask_crop=8) - plain).max() > 1e-2
