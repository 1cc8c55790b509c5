"""The CONTROLS parser and the CONTROLS / CONTROL_IMAGES pairing: every bad value names its field and control."""

import json

import pytest

from maskedit_common.controls import (FIELD, IMAGES, ControlSpec, ControlSpecError, check_images, encode,
                                      library_names, parse)


def test_parses_defaults_and_full_entries():
    assert parse(None) == () and parse("") == () and parse("  ") == ()
    assert parse('"edges"') == (ControlSpec("edges"),)
    got = parse(json.dumps([{"name": "edges", "scale": 0.5},
                            {"name": "union", "scale": 1, "start": 0.2, "end": 0.8, "mode": "canny",
                             "preprocess": "canny"}]))
    assert got == (ControlSpec("edges", 0.5), ControlSpec("union", 1.0, 0.2, 0.8, "canny", "canny"))
    assert got[1].mode_index == 3 and got[0].mode_index is None
    assert parse(encode(got)) == got  # the wire form round-trips
    assert parse(b'{"name": "a", "preprocess": "none"}') == (ControlSpec("a"),)


def test_scale_at_follows_the_pipelines_controlnet_keep():
    s = ControlSpec("a", 0.7, start=0.25, end=0.75)
    assert [s.scale_at(i, 4) for i in range(4)] == [0.0, 0.7, 0.7, 0.0]  # 1 - (i/4 < .25 or (i+1)/4 > .75)
    assert [ControlSpec("a", 2.0).scale_at(i, 3) for i in range(3)] == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("value, words", [
    ("[", "not valid JSON"),
    ("3", "must be a list"),
    (b"\xff", "UTF-8"),
    ('["a", "b", "c"]', "3 controls, above the limit of 2"),
    ('[{"scale": 1}]', 'control 0: must be an object with "name"'),
    ('[{"name": "a", "weight": 1}]', "control 0: has unknown keys ['weight']"),
    ('[{"name": "../etc"}]', "control 0: '../etc' is not a ControlNet name"),
    ('[{"name": "a"}, {"name": "b", "scale": -0.1}]', "control 1: scale must be between 0 and 4.0"),
    ('[{"name": "a", "scale": 4.5}]', "control 0: scale must be between 0 and 4.0, got 4.5"),
    ('[{"name": "a", "scale": "x"}]', "control 0: scale must be a number"),
    ('[{"name": "a", "scale": true}]', "control 0: scale must be a number"),
    ('[{"name": "a", "start": -0.5}]', "control 0: start and end must lie in [0, 1]"),
    ('[{"name": "a", "end": 1.5}]', "control 0: start and end must lie in [0, 1]"),
    ('[{"name": "a", "start": 0.6, "end": 0.4}]', "control 0: start (0.6) must be below end (0.4)"),
    ('[{"name": "a", "start": 0.5, "end": 0.5}]', "must be below end"),
    ('[{"name": "a", "mode": "xray"}]', "control 0: mode 'xray' is not a control mode"),
    ('[{"name": "a", "preprocess": "sobel"}]', "control 0: preprocess 'sobel' is not a preprocessor"),
])
def test_bad_values_name_the_field_and_the_control(value, words):
    with pytest.raises(ControlSpecError) as e:
        parse(value)
    assert e.value.field == FIELD and words in str(e.value)


def test_one_image_per_control():
    specs = parse('["a", "b"]')
    check_images(specs, 2)
    check_images((), 0)
    with pytest.raises(ControlSpecError) as e:
        check_images(specs, 1)
    assert e.value.field == IMAGES and e.value.index == 1 and "no image for ControlNet 'b'" in str(e.value)
    with pytest.raises(ControlSpecError) as e:
        check_images(specs[:1], 2)
    assert e.value.field == FIELD and e.value.index == 1 and "names no ControlNet" in str(e.value)


def test_library_lists_saved_controlnet_directories_only(tmp_path):
    (tmp_path / "edges").mkdir()
    (tmp_path / "edges" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "config.json").write_text("{}")
    (tmp_path / "file.json").write_text("{}")
    assert library_names(tmp_path) == ["edges"]
    assert library_names(tmp_path / "missing") == []


def test_the_wire_format_round_trips_controls_of_any_shapes():
    import numpy as np

    from maskedit.controlnets.job import ControlInput, from_wire, to_wire

    assert to_wire(())[0].shape == (0, 0) and from_wire(np.zeros((0, 0), np.float32), []) == ()
    a = ControlInput(ControlSpec("a", 0.5, 0.1, 0.9), np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    b = ControlInput(ControlSpec("u", mode="depth", preprocess="canny"), np.ones((5, 2), np.float32))
    rows, info = to_wire((a, b))
    back = from_wire(rows, json.loads(json.dumps(info)))  # REQUEST_INFO travels as JSON
    assert [c.spec for c in back] == [a.spec, b.spec]
    for got, want in zip(back, (a, b)):
        np.testing.assert_array_equal(got.image, want.image)
