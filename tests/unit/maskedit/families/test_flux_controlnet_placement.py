"""Flux ControlNets placed in the ``controlnet`` model (docs/controlnet_flux.md, "Placement"): the BLS provider with
the controlnet model's own logic as its transport (packing, ``ControlNetService``) gives the in-process latents for
both Flux paths (``flux_controlnet``; Flux Fill's ControlNet extension) in a mixed batch, the transformer's first
block runs before the residuals are collected (the overlap), and a failing ControlNet call fails only its requests.
The real BLS path through tritonserver is tests/integration/test_flux_controlnet_serving.py."""

import json
import shutil

import numpy as np
import pytest
import torch

from maskedit.controlnets import flux_remote, wire
from maskedit.controlnets.provider import ControlNetFailed, TritonProvider
from maskedit.controlnets.service import ControlNetService
from maskedit.denoise import ModelRunner
from maskedit.families.flux_controlnet.tiny import PRESETS, Net, build, controlnet
from maskedit.local import LocalEditor, denoise_inputs
from maskedit.params import parse_params
from maskedit.settings import load_settings
from tests.conftest import png

from .cn_util import box_mask, edges, one_batch, template

STEPS = 3
ATOL = 1e-5  # one request per ControlNet call there, several batched here: float32 rounding may differ


def _break(lib, name, like="canny"):
    """A valid config (admitted from it) with weights the controlnet model cannot load."""
    shutil.copytree(lib / like, lib / name)
    for f in (lib / name).glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")


@pytest.fixture(scope="module")
def flux_cn(tmp_path_factory):
    d = build(tmp_path_factory.mktemp("flux-cn-place") / "flux-cn-tiny", "flux-cn-tiny", seed=0)
    _break(d / "controlnets", "broken")
    env = {"MASKEDIT_MODEL_DIR": str(d), "MASKEDIT_DEVICE": "cpu", "MASKEDIT_CACHE": "off"}
    return load_settings(env), load_settings({**env, "MASKEDIT_CONTROLNET_PLACEMENT": "triton"})


@pytest.fixture(scope="module")
def fill(settings, tmp_path_factory):
    lib = tmp_path_factory.mktemp("fill-place-controlnets")
    p = PRESETS["flux-cn-tiny"]  # the tiny Fill model's widths
    controlnet(p, Net(1, 2), seed=1).save_pretrained(lib / "canny")
    controlnet(p, Net(2, 1, num_mode=7), seed=2).save_pretrained(lib / "union")
    _break(lib, "broken")
    env = {"MASKEDIT_MODEL_DIR": str(settings.model_dir), "MASKEDIT_DEVICE": "cpu", "MASKEDIT_CACHE": "off",
           "MASKEDIT_CONTROLNET_DIR": str(lib)}
    return load_settings(env), load_settings({**env, "MASKEDIT_CONTROLNET_PLACEMENT": "triton"})


MIXED = [None, [{"name": "canny", "scale": 0.8}],
         [{"name": "depth", "scale": 0.6, "start": 0.4}, {"name": "union", "scale": 0.7, "mode": "pose"}],
         [{"name": "union", "scale": 0.9, "mode": "canny", "end": 0.5}, {"name": "canny", "scale": 0.5}]]
FILL_MIXED = [None, [{"name": "canny", "scale": 0.8}],
              [{"name": "union", "scale": 0.7, "mode": "depth", "start": 0.4}, {"name": "canny", "scale": 0.6}]]


def _inputs(ed, s, specs):
    out = []
    for i, spec in enumerate(specs):
        params = parse_params(s, "a red hat", seed=10 + i, steps=STEPS, controls=json.dumps(spec) if spec else None)
        images = [png(edges(seed=20 + k)) for k in range(len(spec or ()))]
        out.append(denoise_inputs(ed.pre(png(template(seed=1)), png(box_mask()), params, images)))
    return out


def _placed(s_triton, transformer):
    runner = ModelRunner(s_triton, transformer=transformer)
    runner._control_provider = TritonProvider(ControlNetService(s_triton).run, runner.device, runner.dtype)
    return runner


def _bls_equals_in_process(s, s_triton, specs):
    ed = LocalEditor(s)
    try:
        inputs = _inputs(ed, s, specs)
        ref, ref_errors = one_batch(ModelRunner(s, transformer=ed.runner.transformer), inputs)
        runner = _placed(s_triton, ed.runner.transformer)
        got, errors = one_batch(runner, inputs)
        runner.control_provider.close()
    finally:
        ed.close()
    assert ref_errors == errors == [None] * len(specs)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a.result(), b.result(), atol=ATOL, rtol=0)
    assert max(np.abs(ref[0].result() - r.result()).max() for r in ref[1:]) > 1e-2  # the controls matter
    assert all(c.model is None for j in got for c in j.controls)  # placed remotely: the denoiser loaded no weights
    assert got[0].control_bls_s == 0 and all(j.control_bls_s >= j.control_model_s > 0 for j in got[1:])
    return runner.control_provider.stats.snapshot()


def test_flux_controlnet_bls_equals_in_process_in_a_mixed_batch(flux_cn):
    """No control; one; two on different ControlNets (one windowed, one union); a union on part of the schedule then
    a plain one (its structure is the union's): the in-process latents, one BLS call per request and acting step."""
    st = _bls_equals_in_process(*flux_cn, MIXED)
    # request 1: 3 steps; 2: depth acts from 0.4 (steps 1-2) and union always: 3; 3: canny always: 3
    assert st["calls"] == 3 * STEPS and st["steps"] == STEPS and st["failures"] == 0
    assert 0 < st["model_s"] <= st["bls_s"]


def test_flux_fill_controlnet_extension_bls_equals_in_process(fill):
    st = _bls_equals_in_process(*fill, FILL_MIXED)
    assert st["calls"] == 2 * STEPS and st["failures"] == 0


@pytest.mark.parametrize("which", ["flux_cn", "fill"])
def test_a_failing_controlnet_call_fails_only_its_requests(which, request):
    """The controlnet model cannot load 'broken': the two requests naming it fail naming CONTROLS and the
    ControlNet; their batch-mates (none, and a working ControlNet) finish and equal their runs alone."""
    s, s_triton = request.getfixturevalue(which)
    ed = LocalEditor(s)
    try:
        inputs = _inputs(ed, s_triton, [None, [{"name": "broken"}], [{"name": "canny", "scale": 0.8}],
                                        [{"name": "canny", "scale": 0.5}, {"name": "broken", "start": 0.5}]])
        plain = ModelRunner(s, transformer=ed.runner.transformer)
        alone = [one_batch(plain, [x])[0][0] for x in (inputs[0], inputs[2])]
        runner = _placed(s_triton, ed.runner.transformer)
        jobs, errors = one_batch(runner, inputs)
        runner.control_provider.close()
    finally:
        ed.close()
    assert errors[0] is None and errors[2] is None
    np.testing.assert_allclose(jobs[0].result(), alone[0].result(), atol=ATOL, rtol=0)  # batched: rounding
    np.testing.assert_allclose(jobs[2].result(), alone[1].result(), atol=ATOL, rtol=0)
    for e in (errors[1], errors[3]):
        assert isinstance(e, ControlNetFailed) and e.code == "INTERNAL" and str(e).startswith("CONTROLS: ")
        assert "ControlNet 'broken' could not be loaded (OSError)" in str(e)
    assert jobs[3].step_index == 2  # it failed at the step its broken control first acts (0.5 of 3 steps)


class _Spy:
    """The transformer's first double block, noting whether the residuals had been collected when it ran."""

    def __init__(self, late_calls):
        self.late_calls, self.seen = late_calls, []

    def __call__(self, module, args, kwargs):
        self.seen.append(len(self.late_calls))


def test_the_first_block_runs_before_the_residuals_are_collected(flux_cn, monkeypatch):
    """The overlap: with the controlnet model placement the transformer's embeddings, rotary tables and first double
    block run before the step's calls are collected (in-process they are computed before the transformer starts)."""
    s, s_triton = flux_cn
    collected = []
    real = flux_remote.collect
    monkeypatch.setattr(flux_remote, "collect", lambda *a: (collected.append(1), real(*a))[1])
    ed = LocalEditor(s)
    try:
        inputs = _inputs(ed, s, MIXED[:2])
        runner = _placed(s_triton, ed.runner.transformer)
        spy = _Spy(collected)
        handle = runner.transformer.transformer_blocks[0].register_forward_pre_hook(spy, with_kwargs=True)
        try:
            _, errors = one_batch(runner, inputs)
        finally:
            handle.remove()
            runner.control_provider.close()
    finally:
        ed.close()
    assert errors == [None, None] and len(collected) == STEPS
    assert spy.seen == list(range(STEPS))  # at each step the first block ran before that step's collection


def test_flux_request_and_residuals_round_trip_the_wire():
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 64, 16, generator=g), timestep=torch.tensor([0.75]),
                  guidance=torch.tensor([3.5]), pooled_projections=torch.randn(1, 32, generator=g),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g), txt_ids=torch.zeros(8, 3),
                  img_ids=torch.randn(64, 3, generator=g), structure=(2, None))
    lat = [torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)]
    controls, got = wire.unpack_request(wire.pack_request(
        [("canny", 0.8, None, lat[0]), ("union", 0.5, "depth", lat[1])], inputs), "cpu", torch.float32)
    assert [(n, s, m) for n, s, m, _ in controls] == [("canny", 0.8, None), ("union", 0.5, "depth")]
    assert all(torch.equal(c[3], x) for c, x in zip(controls, lat))
    assert got["structure"] == (2, None) and got["guidance"].dtype == torch.float32
    for k, v in inputs.items():
        if k != "structure":
            assert torch.equal(got[k], v), k
    res = [torch.randn(1, 64, 32, generator=g) for _ in range(3)]
    back = wire.unpack_residuals(wire.pack_residuals(res, [2, 1]), "cpu", torch.float32)
    double, single = flux_remote.split(back)
    assert back.groups == (2, 1) and len(double) == 2 and len(single) == 1
    assert torch.equal(double[1], res[1][0]) and torch.equal(single[0], res[2][0])
    assert flux_remote.split(wire.unpack_residuals(wire.pack_residuals(res[:1], [-1, 1]), "cpu", torch.float32))[0] \
        is None
