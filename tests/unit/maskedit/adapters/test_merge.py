"""The merged (fused) LoRA path: a call whose requests all carry one adapter set runs with ``W + Σ s·B@A``; its
results equal the unmerged deltas' within float tolerance, the base weights stay bit-identical, merged copies keep
to their byte budget, and the cost model picks merging only where it pays."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from maskedit import samples
from maskedit.adapters import merge
from maskedit.adapters.delta import BatchPlan
from maskedit.denoise import DenoiseJob
from maskedit.local import LocalEditor, denoise_inputs
from maskedit.params import parse_params
from maskedit.settings import load_settings
from tests.conftest import atol, png
from tests.unit.maskedit.adapters.lora_models import (SIZE as STOCK_SIZE, model_with_library, served_edit,
                                                      stock_latents, stock_pipeline)

STEPS = 2
SIZE = 128
TWO = (("attn-mlp-r16", 0.7), ("attn-r64", -0.4))


def _editor(tmp_path_factory, preset):
    return LocalEditor(model_with_library(tmp_path_factory.mktemp(preset), preset))


@pytest.fixture(scope="module")
def editor(tmp_path_factory):
    """The tiny Flux Fill model with its adapter library, and two requests' inputs (adapters set per test)."""
    ed = _editor(tmp_path_factory, "tiny")
    s = ed.settings
    tpl = samples.template(SIZE, SIZE, seed=2)
    ed.test_inputs = [denoise_inputs(ed.pre(png(tpl), png(samples.mask(SIZE, SIZE, 0.2 + 0.1 * i, "box", seed=i)),
                                            parse_params(s, "a red hat", seed=i, steps=STEPS, guidance=12.0,
                                                         use_cache=False))) for i in range(2)]
    yield ed
    ed.close()


@pytest.fixture(scope="module")
def sdxl_editor(tmp_path_factory):
    ed = _editor(tmp_path_factory, "sdxl-tiny")
    yield ed
    ed.close()


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny"])
def test_merged_equals_stock_fuse_lora(preset, editor, request):
    """The merged path against the stock pipeline's own merge (``load_lora_weights``, ``set_adapters``,
    ``fuse_lora``): same components, inputs and seed, two adapters with different scales (test_lora compares the
    unmerged path with PEFT's unmerged layers)."""
    ed = editor if preset == "tiny" else request.getfixturevalue("sdxl_editor")
    m = merge.merger_for(ed.runner.transformer)
    tpl = samples.template(STOCK_SIZE, STOCK_SIZE, seed=1)
    mask = samples.mask(STOCK_SIZE, STOCK_SIZE, 0.25, "box", seed=1)
    m.mode, before = "always", dict(m.stats)
    try:
        _, p, job = served_edit(preset, ed, tpl, mask, list(TWO))
    finally:
        m.mode = ed.settings.lora_merge  # the editor's pinned path (lora_models.model_with_library)
    assert m.stats["merged_calls"] > before["merged_calls"]
    pipe = stock_pipeline(ed.settings, list(TWO))
    pipe.fuse_lora(adapter_names=[n for n, _ in TWO])
    ref = stock_latents(preset, ed.settings, pipe, tpl, mask, p, 5)
    np.testing.assert_allclose(job.result(), ref, atol=atol(ed.settings, 1e-5), rtol=0)


def _inputs(ed, loras, n=2):
    refs = tuple({"name": name, "scale": w, "digest": ""} for name, w in loras or ())
    return [replace(x, loras=refs) for x in ed.test_inputs[:n]]


def _run(ed, inputs, mode, budget=merge.DEFAULT_BUDGET, clear=True):
    m = merge.merger_for(ed.runner.transformer)
    m.mode, m.budget = mode, budget
    if clear:
        m.clear()
    before = dict(m.stats)
    jobs = [DenoiseJob(x) for x in inputs]
    try:
        for j in jobs:
            ed.runner.prepare(j)
        while not all(j.done for j in jobs):
            ed.runner.step([j for j in jobs if not j.done])
    finally:
        m.mode, m.budget = ed.settings.lora_merge, merge.DEFAULT_BUDGET
    return [j.result() for j in jobs], {k: m.stats[k] - before[k] for k in before}


def test_merged_equals_unmerged_and_base_weights_stay_bit_identical(editor):
    """A batch of two requests with one two-adapter set: merged (copies held across steps, and made per call with
    no budget) equals the unmerged deltas within float rounding, the adapters move latents by far more, and the
    base weights are bit-identical (same values, same storage) afterwards."""
    s = editor.settings
    t = editor.runner.transformer
    before = {k: (v.clone(), v.data_ptr()) for k, v in t.state_dict().items()}
    ins = _inputs(editor, TWO)
    unmerged, st = _run(editor, ins, "never")
    assert st["merged_calls"] == 0
    merged, st = _run(editor, ins, "always")
    assert st["merged_calls"] > 0 and st["unmerged_calls"] == 0
    assert st["merges"] < st["merged_calls"], "the merged copies should be reused across steps"
    per_call, st = _run(editor, ins, "always", budget=0)
    assert st["merges"] == st["merged_calls"] > 0 and merge.merger_for(t).resident_bytes == 0
    plain, _ = _run(editor, _inputs(editor, None), "never")
    for u, m, c, p in zip(unmerged, merged, per_call, plain):
        np.testing.assert_allclose(m, u, atol=atol(s, 1e-5), rtol=0)
        np.testing.assert_allclose(c, u, atol=atol(s, 1e-5), rtol=0)
        assert np.abs(u - p).max() > 1e-3, "the adapters changed nothing"
    after = t.state_dict()
    assert before.keys() == after.keys()
    for k, (v, ptr) in before.items():
        assert torch.equal(v, after[k]) and after[k].data_ptr() == ptr, k


def test_merged_copies_keep_to_their_budget(editor):
    """A budget holding one set's copies: a second set evicts the first (what does not fit is merged per call),
    and each still equals unmerged."""
    s = editor.settings
    m = merge.merger_for(editor.runner.transformer)
    one = (("attn-r4", 0.9),)
    _run(editor, _inputs(editor, one, 1), "always")
    size = m.resident_bytes
    assert size > 0
    for loras in (one, (("attn-mlp-r8", 1.1),)):
        ins = _inputs(editor, loras, 1)
        got, st = _run(editor, ins, "always", budget=size, clear=False)
        assert 0 < m.resident_bytes <= size and len(m._sets) == 1
        ref, _ = _run(editor, ins, "never")
        np.testing.assert_allclose(got[0], ref[0], atol=atol(s, 1e-5), rtol=0)


def test_the_cost_model_merges_only_where_it_pays():
    c = merge.Costs(delta_flops=1e11, merge_flops=2e10, layer_s=2e-5)
    # FLUX.1 widths, 1 token row (e.g. a projection of the pooled text): one merge costs far more than its deltas
    assert not c.prefer_merge(1, 3072, 3072, [16], calls=1)
    # ... but spread over 28 steps at 4096 image tokens it pays
    assert c.prefer_merge(4096, 3072, 3072, [16], calls=28)
    # a tiny layer where the per-call fixed cost of the deltas dominates: merge even for one call
    assert c.prefer_merge(64, 32, 32, [4], calls=1)
    assert c.unmerged_s(4096, 3072, 3072, [16, 16]) == pytest.approx(2 * c.unmerged_s(4096, 3072, 3072, [16]))


def test_only_a_call_with_one_set_merges(editor):
    rt = editor.runner.adapters
    a = rt.resolve([{"name": "attn-r4", "scale": 0.8, "digest": ""}])
    b = rt.resolve([{"name": "attn-r4", "scale": 0.5, "digest": ""}])
    m = merge.Merger()
    assert m.plan([(), ()]) is None
    assert isinstance(m.plan([a, a, a]), merge.MergedPlan)
    for mixed in ([a, b], [a, ()], [(), a]):  # another scale, or a request without adapters
        p = m.plan(mixed)
        assert isinstance(p, BatchPlan) and not isinstance(p, merge.MergedPlan)
    m.mode = "never"
    assert not isinstance(m.plan([a, a]), merge.MergedPlan)
    with pytest.raises(ValueError):
        merge.Merger(mode="sometimes")


def test_measured_costs_are_positive():
    c = merge.Costs.measure(64, 64, 256, 8, "cpu", torch.float32, reps=2)
    assert c.delta_flops > 0 and c.merge_flops > 0 and c.layer_s >= 0


def test_the_merger_takes_its_mode_and_budget_from_the_settings(tmp_path):
    s = replace(load_settings({"MASKEDIT_MODEL_DIR": str(tmp_path), "MASKEDIT_LORA_MERGE": "never",
                               "MASKEDIT_LORA_MERGE_BYTES": "12345"}))
    m = merge.merger_for(torch.nn.Linear(2, 2), s)
    assert (m.mode, m.budget) == ("never", 12345)
