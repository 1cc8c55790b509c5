"""ControlNet placement (docs/controlnet.md, "Placement"): the ``controlnet`` model's request / response packing
round trip, the BLS residual provider (its transport the ``controlnet`` model's own logic, in this process) equal
to the in-process provider bit for bit in a mixed batch, and a failing ControlNet call failing only its request.
The real BLS path through tritonserver is tests/integration/test_controlnet_placement.py."""

import json
import shutil

import numpy as np
import pytest
import torch

from maskedit import samples
from maskedit.controlnets import wire
from maskedit.controlnets.provider import ControlNetFailed, InProcessProvider, TritonProvider
from maskedit.controlnets.service import ControlNetService
from maskedit.denoise import ModelRunner
from maskedit.families import family_for
from maskedit.families.unet_inpaint.tiny import build_unet
from maskedit.local import LocalEditor, denoise_inputs
from maskedit.params import parse_params
from maskedit.settings import load_settings
from tests.conftest import png

from .cn_util import one_batch

SIZE, STEPS = 64, 3


def test_packed_request_and_residuals_unpack_to_the_same_tensors():
    g = torch.Generator().manual_seed(0)
    res = [torch.randn(4, c, s, s, generator=g) for c, s in ((32, 8), (32, 8), (64, 4), (64, 4))]
    back = wire.unpack_residuals(wire.pack_residuals(res), "cpu", torch.float32)
    assert len(back) == 4 and all(torch.equal(a, b) for a, b in zip(res, back))
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([999.0, 999.0]),
              "encoder_hidden_states": torch.randn(2, 77, 32, generator=g),
              "added_cond_kwargs": {"text_embeds": torch.randn(2, 32, generator=g), "time_ids": torch.randn(2, 6)}}
    images = [torch.rand(3, 64, 64, generator=g), torch.rand(3, 64, 64, generator=g)]
    controls, got = wire.unpack_request(wire.pack_request(
        [("canny", 0.8, None, images[0]), ("union", 0.5, "depth", images[1])], inputs), "cpu", torch.float32)
    assert [(n, s, m) for n, s, m, _ in controls] == [("canny", 0.8, None), ("union", 0.5, "depth")]
    assert all(torch.equal(c[3], i) for c, i in zip(controls, images))
    for k in ("sample", "timestep", "encoder_hidden_states"):
        assert torch.equal(got[k], inputs[k])
    assert all(torch.equal(got["added_cond_kwargs"][k], v) for k, v in inputs["added_cond_kwargs"].items())
    sd2 = dict(inputs, added_cond_kwargs=None)  # SD 2: no added conditioning travels
    assert "TEXT_EMBEDS" not in wire.pack_request([("canny", 1.0, None, images[0])], sd2)


@pytest.fixture(scope="module")
def model(tmp_path_factory, settings):
    d = tmp_path_factory.mktemp("cn-place") / "model"
    build_unet(d, "sdxl-tiny")
    family_for(d).build_controlnets(d / "controlnets", seed=0)
    broken = d / "controlnets" / "broken"  # a valid config (it passes admission) with weights that cannot load
    shutil.copytree(d / "controlnets" / "canny", broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    env = {"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DTYPE": settings.dtype, "MASKEDIT_DEVICE": settings.device}
    return load_settings(env), load_settings({**env, "MASKEDIT_CONTROLNET_PLACEMENT": "triton"})


def _inputs(ed, s, specs):
    tpl, mask = samples.template(SIZE, SIZE, seed=1), samples.mask(SIZE, SIZE, 0.25, "box", seed=1)
    ctl = [samples.template(SIZE, SIZE, seed=7), samples.template(48, 80, seed=8)]
    out = []
    for i, spec in enumerate(specs):
        params = parse_params(s, "a red hat", seed=10 + i, steps=STEPS, guidance=7.5,
                              controls=json.dumps(spec) if spec else None)
        out.append(denoise_inputs(ed.pre(png(tpl), png(mask), params, [png(c) for c in ctl[:len(spec or ())]])))
    return out


def test_bls_provider_equals_in_process_in_a_mixed_batch(model):
    """A step with a request without controls, one with one ControlNet and one with two (one union): the residuals
    through the controlnet model's packing and logic (its calls in flight together, the UNet's down blocks running
    meanwhile) give the in-process latents exactly."""
    s, s_triton = model
    ed = LocalEditor(s)
    try:
        specs = [None, [{"name": "canny", "scale": 0.8}],
                 [{"name": "depth", "scale": 0.6, "start": 0.4}, {"name": "union", "scale": 0.7, "mode": "pose"}]]
        inputs = _inputs(ed, s, specs)
        local = ModelRunner(s, transformer=ed.runner.transformer)
        assert isinstance(local.control_provider, InProcessProvider)
        ref, _ = one_batch(local, inputs)
        remote = ModelRunner(s_triton, transformer=ed.runner.transformer)
        remote._control_provider = p = TritonProvider(ControlNetService(s_triton).run, remote.device, remote.dtype)
        got, errors = one_batch(remote, inputs)
        p.close()
    finally:
        ed.close()
    assert errors == [None] * 3
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.result(), b.result())
    assert all(j.controls[0].model is None for j in got[1:])  # placed remotely: the denoiser loaded no weights
    assert got[1].control_bls_s > 0 and got[0].control_bls_s == 0
    st = p.stats.snapshot()
    assert st["calls"] == 2 * STEPS and st["steps"] == STEPS and st["failures"] == 0  # one call per request and step
    assert 0 < st["model_s"] <= st["bls_s"] and got[1].control_model_s > 0  # the model reports its own time


def test_a_failing_controlnet_call_fails_only_its_request(model):
    """The controlnet model cannot load 'broken' (its weights are corrupt): that request fails naming CONTROLS and
    the ControlNet; its batch-mate without controls finishes and equals its run alone."""
    s, s_triton = model
    ed = LocalEditor(s)
    try:
        inputs = _inputs(ed, s_triton, [None, [{"name": "broken"}]])
        alone, _ = one_batch(ModelRunner(s, transformer=ed.runner.transformer), inputs[:1])
        runner = ModelRunner(s_triton, transformer=ed.runner.transformer)
        runner._control_provider = p = TritonProvider(ControlNetService(s_triton).run, runner.device, runner.dtype)
        jobs, errors = one_batch(runner, inputs)
        p.close()
    finally:
        ed.close()
    assert errors[0] is None
    np.testing.assert_array_equal(jobs[0].result(), alone[0].result())
    assert isinstance(errors[1], ControlNetFailed) and errors[1].code == "INTERNAL"
    assert str(errors[1]) == ("CONTROLS: the controlnet model failed for ControlNet 'broken': CONTROLS: control 0: "
                              "ControlNet 'broken' could not be loaded (OSError)")
    assert p.stats.snapshot()["failures"] == 1  # not retried: a timeout is not waited for twice
