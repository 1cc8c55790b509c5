"""The CLI sends the stock pipelines' parameters and writes the result in the format it asked for."""

import numpy as np

from maskedit_client import cli
from maskedit_client import client as client_mod
from maskedit_client.results import EditResult
from tests.conftest import png


def test_cli_sends_the_diffusers_parameters_and_names_the_file_by_format(tmp_path, monkeypatch):
    files = []
    for name in ("tpl", "mask"):
        p = tmp_path / f"{name}.png"
        p.write_bytes(png(np.zeros((16, 16, 3), np.uint8)))
        files.append(p)
    sent = {}

    def fake_edit(self, template, mask, prompt, **kw):
        sent.update(kw)
        return EditResult(b"\xff\xd8\xff jpeg bytes", {"cache": "off"})

    monkeypatch.setattr(client_mod.EditClient, "edit", fake_edit)
    monkeypatch.chdir(tmp_path)
    args = ["--template", str(files[0]), "--mask", str(files[1]), "--prompt", "x", "--url", "127.0.0.1:1",
            "--strength", "0.6", "--padding-mask-crop", "32", "--guidance-rescale", "0.7", "--true-cfg-scale", "4",
            "--output-format", "jpeg", "--output-quality", "80"]
    assert cli.main(args) == 0
    assert {k: sent[k] for k in ("strength", "padding_mask_crop", "guidance_rescale", "true_cfg_scale",
                                 "output_format", "output_quality")} == {
        "strength": 0.6, "padding_mask_crop": 32, "guidance_rescale": 0.7, "true_cfg_scale": 4.0,
        "output_format": "jpeg", "output_quality": 80}
    assert (tmp_path / "result.jpg").read_bytes().startswith(b"\xff\xd8\xff")
