"""The serving benchmark's parts against real servers: the stock-Diffusers baseline served by Triton answers like
``FluxFillPipeline`` and refuses bad input by field."""

import io

import numpy as np
import pytest
from PIL import Image

from maskedit import samples
from maskedit.launcher import TritonServer
from maskedit_lab.serving import bench_serving, stock
from tests.conftest import png


@pytest.fixture(scope="module")
def baseline(settings, tmp_path_factory):
    d = tmp_path_factory.mktemp("baseline")
    stock.render(d / "repo")
    env = {"MASKEDIT_MODEL_DIR": str(settings.model_dir),
           "MASKEDIT_PYTHONPATH": bench_serving.lab_pythonpath()}
    with TritonServer(d / "repo", env=env, log_path=d / "server.log").start() as s:
        c = bench_serving.BaselineClient(s.grpc_url)
        yield c
        c.close()


def test_the_stock_baseline_served_by_triton_edits_like_diffusers(baseline, settings):
    tpl, mask = samples.template(300, 200, seed=3), samples.mask(300, 200, 0.2, "box", seed=3)
    info = baseline.submit(png(tpl), png(mask), "a red hat", seed=5, steps=2).result(120).info
    assert info["baseline"] == "diffusers" and info["steps"] == 2 and info["pipeline_s"] > 0
    editor = stock.StockEditor(settings)
    image, _ = editor.edit(png(tpl), png(mask), "a red hat", seed=5, steps=2)
    assert Image.open(io.BytesIO(image)).size == (300, 200)


def test_the_stock_baseline_refuses_bad_input_by_field(baseline):
    with pytest.raises(Exception, match="MASK"):
        baseline.submit(png(samples.template(64, 64, seed=1)), b"not an image", "x").result(60)
    ok = baseline.submit(png(samples.template(64, 64, seed=1)), png(np.full((64, 64), 255, np.uint8)), "x",
                         steps=1).result(120)  # and it keeps serving
    assert ok.info["steps"] == 1


# The minimal benchmark run (both systems, 3 requests each, its rows and ratios) is the device script's dry run:
# tests/unit/test_device_scripts.py runs it through tools/device/gpu_check.sh, as the GPU machine does.
