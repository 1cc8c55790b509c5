"""The ControlNet library opens only regular files: a FIFO (or device, or socket) named like a ControlNet's file is
refused by name, naming CONTROLS, and nothing waits on it (``open()`` on a FIFO waits for a writer forever; the
loader, ``from_pretrained``, opens the weights by name). As the adapter library (tests/unit/maskedit_router/
test_lora_admin.py)."""

import os
import shutil

import pytest
from maskedit_common.controls import ControlSpec

from maskedit.cache.key import dir_digest
from maskedit.components import family
from maskedit.controlnets.library import ControlNetLibrary
from maskedit.errors import InvalidInput
from tests.blocking import in_time


@pytest.fixture
def library(settings, tmp_path):
    src = settings.controlnets / "canny"
    if not src.is_dir():
        pytest.skip("the tiny model's ControlNet library is built by `make model`")
    root = tmp_path / "controlnets"
    root.mkdir()
    shutil.copytree(src, root / "canny")
    for name in ("fifo-weights", "fifo-config"):
        shutil.copytree(src, root / name)
    (root / "fifo-weights" / "diffusion_pytorch_model.safetensors").unlink()
    os.mkfifo(root / "fifo-weights" / "diffusion_pytorch_model.safetensors")  # what from_pretrained would open
    (root / "fifo-config" / "config.json").unlink()
    os.mkfifo(root / "fifo-config" / "config.json")
    return ControlNetLibrary(root, family(settings), settings)


@pytest.mark.parametrize("name", ["fifo-weights", "fifo-config"])
def test_a_fifo_named_like_a_controlnet_file_is_refused_without_blocking(library, name):
    spec = ControlSpec(name, 1.0)
    for call in (lambda: library.config(name), lambda: library.check((spec,)), lambda: library.load(spec),
                 lambda: library.check_remote(spec)):
        e = in_time(call).get("error")
        assert isinstance(e, InvalidInput) and str(e).startswith("CONTROLS: control 0: "), e
        assert "is a FIFO, not a regular file" in str(e) and name in str(e), str(e)
    in_time(lambda: dir_digest(library.root / name))  # the cache key's digest of it never waits on it either


def test_the_regular_controlnet_beside_them_still_loads(library):
    assert library.config("canny")["_class_name"]
    assert in_time(lambda: library.load(ControlSpec("canny", 1.0))).get("value") is not None
