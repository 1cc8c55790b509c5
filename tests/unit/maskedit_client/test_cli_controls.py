"""The CLI's --control / --control-image arguments and the client's CONTROLS / CONTROL_IMAGES inputs."""

import json

import numpy as np
import pytest

from maskedit_client import cli
from maskedit_client import client as client_mod
from maskedit_client.controls import controls_json


def test_control_arguments():
    assert cli._control_arg("canny") == {"name": "canny"}
    assert cli._control_arg("canny:0.8") == {"name": "canny", "scale": 0.8}
    assert cli._control_arg("union:1:0:0.6:mode=depth") == {"name": "union", "scale": 1.0, "start": 0.0,
                                                           "end": 0.6, "mode": "depth"}
    assert cli._control_arg("canny:0.5:preprocess=canny") == {"name": "canny", "scale": 0.5, "preprocess": "canny"}
    for bad in ("", ":1", "a:1:2", "a:1:color=red"):
        with pytest.raises(ValueError):
            cli._control_arg(bad)


def test_controls_json_shapes():
    assert json.loads(controls_json([("a", 0.5), ("b", 1, 0.1, 0.9)])) == [
        {"name": "a", "scale": 0.5}, {"name": "b", "scale": 1.0, "start": 0.1, "end": 0.9}]
    assert json.loads(controls_json({"name": "u", "mode": "pose"})) == [{"name": "u", "mode": "pose"}]
    assert controls_json('[{"name": "a"}]') == '[{"name": "a"}]'


def test_cli_sends_controls_and_their_images_in_order(tmp_path, monkeypatch):
    from tests.conftest import png

    files = []
    for i, name in enumerate(("tpl", "mask", "c0", "c1")):
        p = tmp_path / f"{name}.png"
        p.write_bytes(png(np.full((16, 16, 3), i * 40, np.uint8)))
        files.append(p)
    sent = {}

    def fake_edit(self, template, mask, prompt, **kw):
        sent.update(kw)
        raise client_mod.EditError("CONTROLS: stop here", "INVALID_ARGUMENT")

    monkeypatch.setattr(client_mod.EditClient, "edit", fake_edit)
    args = ["--template", str(files[0]), "--mask", str(files[1]), "--prompt", "x", "--url", "127.0.0.1:1",
            "--control", "canny:0.8", "--control-image", str(files[2]),
            "--control", "union:1:0:0.5:mode=depth", "--control-image", str(files[3])]
    assert cli.main(args) == 1
    assert sent["controls"] == [{"name": "canny", "scale": 0.8},
                                {"name": "union", "scale": 1.0, "start": 0.0, "end": 0.5, "mode": "depth"}]
    assert sent["control_images"] == files[2:]
    assert cli.main(args[:-2]) == 2  # two controls, one image: refused before sending
