"""Temporal reuse (``maskedit.temporal``): a request alone equals the stock pipeline with the library's hook and the
same settings; no reuse (threshold 0, every step computed) equals the plain path bit for bit; requests with
different policies at different steps in one batch equal each alone; on a cache hit reuse touches its masked rows
only; bad values name TEMPORAL and fail their request alone."""

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import FluxFillPipeline
from PIL import Image

from maskedit import samples
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.components import torch_dtype
from maskedit.denoise import DenoiseJob, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.errors import InvalidInput
from maskedit.families.flux_fill.cache import FluxCacheHooks
from maskedit.local import LocalEditor, denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit.scheduler import BatchScheduler
from maskedit_common.temporal import TemporalSpecError, computed_fraction, parse, step_mask
from tests.conftest import atol, exact_here, png

STEPS = 8
SEED = 5  # SEED == TEMPLATE_SEED: stock Diffusers' draw


@pytest.fixture(scope="module")
def editor(settings):
    ed = LocalEditor(settings)
    yield ed
    ed.close()


def stock_latents(settings, img, mask, setup):
    """The stock FluxFillPipeline (its own transformer, the library's hook applied by ``setup``), latents out."""
    pipe = FluxFillPipeline.from_pretrained(settings.model_dir, dtype=torch_dtype(settings)).to(settings.torch_device)
    setup(pipe)
    w, h = img.size
    out = pipe(prompt="a red hat", image=img, mask_image=Image.fromarray(mask), height=h, width=w,
               num_inference_steps=STEPS, guidance_scale=12.0, max_sequence_length=settings.max_sequence_length,
               generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent").images
    return out[0].float().cpu().numpy()


def ours(editor, img, mask, temporal):
    _, _, job = editor.edit(png(img), png(mask), "a red hat", seed=SEED, steps=STEPS, guidance=12.0,
                            raw_output=True, template_seed=SEED, temporal=temporal)
    return job


def first_block_cache(threshold):
    def setup(pipe):
        from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
        from diffusers.hooks.hooks import CacheContext, _set_cache_context

        apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=threshold))
        # FluxFillPipeline names no cache context (FluxPipeline does: "cond"); one for the whole call
        _set_cache_context(pipe.transformer, CacheContext("cond"))
    return setup


def cache_dit_dbcache(steps, order=0):
    def setup(pipe):
        import cache_dit
        from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

        mask = [1 if i in steps else 0 for i in range(STEPS)]
        extra = {"calibrator_config": TaylorSeerCalibratorConfig(taylorseer_order=order)} if order else {}
        cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=0, residual_diff_threshold=0.0,
            steps_computation_mask=mask, steps_computation_policy="static", num_inference_steps=STEPS), **extra)
    return setup


def test_first_block_cache_alone_equals_stock_fill_pipeline_with_diffusers_hook(editor, settings, template_img,
                                                                             box_mask):
    job = ours(editor, template_img, box_mask, {"policy": "fbcache", "threshold": 0.3})
    steps = job.temporal.info()["temporal_steps"]
    assert "R" in steps and "C" in steps[1:], steps  # reused and computed steps both occur on this model
    ref = stock_latents(settings, template_img, box_mask, first_block_cache(0.3))
    np.testing.assert_allclose(job.result(), ref, atol=atol(settings, 1e-5), rtol=0)
    if exact_here(settings):
        assert np.array_equal(job.result(), ref)


@pytest.mark.parametrize("temporal,order", [({"policy": "steps", "steps": [0, 1, 2, 4, 6]}, 0),
                                            ({"policy": "taylorseer", "order": 2, "steps": [0, 1, 2, 3, 5, 7]}, 2)],
                         ids=["step-mask", "taylorseer-2"])
def test_step_mask_and_taylorseer_alone_equal_stock_fill_pipeline_with_cache_dit(editor, settings, template_img,
                                                                                 box_mask, temporal, order):
    job = ours(editor, template_img, box_mask, temporal)
    info = job.temporal.info()
    assert info["temporal_steps"] == "".join("C" if i in temporal["steps"] else "R" for i in range(STEPS))
    assert info["temporal_computed_fraction"] == pytest.approx(computed_fraction(parse(temporal, STEPS), STEPS, 4))
    ref = stock_latents(settings, template_img, box_mask, cache_dit_dbcache(temporal["steps"], order))
    np.testing.assert_allclose(job.result(), ref, atol=atol(settings, 1e-5), rtol=0)


@pytest.fixture(scope="module")
def inputs(settings, template_img, box_mask):
    pre = Preprocessor(settings)
    return lambda steps=STEPS, **kw: denoise_inputs(pre(png(template_img), png(box_mask),
                                                        parse_params(settings, "a hat", steps=steps, **kw)))


@pytest.mark.parametrize("temporal", [{"policy": "fbcache", "threshold": 0},
                                      {"policy": "dbcache", "threshold": 0.0, "fn": 2, "bn": 1},
                                      {"policy": "steps", "steps": list(range(STEPS))}], ids=["fb0", "db0", "all"])
def test_no_reuse_equals_the_plain_path_bit_for_bit(runner, inputs, temporal):
    eng = DenoiseEngine(runner)
    try:
        plain = run_job(eng, inputs())
        job = run_job(eng, replace(inputs(), temporal=temporal))
    finally:
        eng.shutdown()
    assert job.temporal.info()["temporal_steps"] == "C" * STEPS
    assert torch.equal(torch.from_numpy(job.result()), torch.from_numpy(plain.result()))


MIXED = [None, {"policy": "fbcache", "threshold": 0.3}, {"policy": "steps", "steps": [0, 2, 3, 5]},
         {"policy": "taylorseer", "order": 1, "threshold": 0.25, "fn": 2}]


def _run(engine, xs, stagger=None):
    """Submit ``xs`` (``stagger``: the later ones once the first has taken a step); wait for all."""
    jobs, done = [], []
    first_step = threading.Event()
    for k, x in enumerate(xs):
        ev = threading.Event()
        errs = []
        job = DenoiseJob(x, on_done=lambda j, ev=ev: ev.set(), on_error=lambda j, e, ev=ev, errs=errs: (
            errs.append(e), ev.set()), on_step=(lambda j: first_step.set()) if k == 0 else None)
        jobs.append((job, ev, errs))
        engine.submit(job)
        if stagger and k == 0:
            assert first_step.wait(60)
    for _, ev, errs in jobs:
        assert ev.wait(120)
        assert not errs, errs
    return [j for j, _, _ in jobs]


@pytest.mark.parametrize("batching", ["continuous", "priority"])
def test_mixed_batch_at_different_steps_equals_each_alone(runner, inputs, batching):
    """Requests without and with different policies (and different step counts), joining at different steps,
    share each step's transformer call; under ``priority`` with one slot they are also paused and resumed."""
    xs = [replace(inputs(steps=STEPS if k % 2 else 6), temporal=t) for k, t in enumerate(MIXED)]
    sched = BatchScheduler(batching, max_batch=4 if batching == "continuous" else 2)
    eng = DenoiseEngine(runner, scheduler=sched)
    try:
        together = _run(eng, xs, stagger=True)
        assert eng.max_running > 1
    finally:
        eng.shutdown()
    solo = DenoiseEngine(runner)
    try:
        for x, job in zip(xs, together):
            alone = run_job(solo, x)
            np.testing.assert_allclose(job.result(), alone.result(), atol=atol(runner.settings, 1e-5), rtol=0)
            if x.temporal is not None:
                assert job.temporal.outcomes == alone.temporal.outcomes
    finally:
        solo.shutdown()
    assert any("R" in j.temporal.info()["temporal_steps"] for j in together if j.temporal is not None)


def test_packed_resolutions_with_reuse_equal_each_alone(runner, settings):
    pre = Preprocessor(settings)

    def make(w, h, seed, temporal):
        tpl, mask = samples.template(w, h, seed=seed), samples.mask(w, h, 0.2, "blob", seed=seed)
        return denoise_inputs(pre(png(tpl), png(mask), parse_params(settings, "a hat", steps=6,
                                                                     temporal=temporal)))

    xs = [make(256, 256, 1, '{"policy": "steps", "steps": [0, 1, 3]}'), make(320, 160, 2, None),
          make(256, 128, 3, '{"policy": "fbcache", "threshold": 0.3}')]
    r = ModelRunner(settings, transformer=runner.transformer)
    jobs = [DenoiseJob(x) for x in xs]
    for j in jobs:
        r.prepare(j)
    while not all(j.done for j in jobs):
        r.step([j for j in jobs if not j.done])
    eng = DenoiseEngine(r)
    try:
        for x, job in zip(xs, jobs):
            alone = run_job(eng, x)
            np.testing.assert_allclose(job.result(), alone.result(), atol=atol(settings, 1e-5), rtol=0)
    finally:
        eng.shutdown()
    assert "R" in jobs[0].temporal.info()["temporal_steps"]


@pytest.fixture(scope="module")
def cached(settings, tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    store = ActivationStore(d / "mem", d / "disk", 1 << 30, 1 << 30)
    pre = Preprocessor(settings, store=store)
    runner = ModelRunner(settings)
    rt = CacheRuntime(FluxCacheHooks.of(runner.transformer), store)
    eng = DenoiseEngine(ModelRunner(settings, transformer=runner.transformer, cache=rt), max_batch=4)
    yield pre, eng, rt
    eng.shutdown()
    rt.close()


def test_a_cache_hit_reuses_on_its_masked_rows_only(cached, settings):
    """A hit with a step mask: its unmasked tokens come from the entry at every step, reused or not (their latents
    equal the same hit's without reuse bit for bit); threshold 0 equals the hit without reuse bit for bit; the
    template run computes every block; and hits with and without reuse batched equal each alone."""
    pre, eng, rt = cached
    tpl, mask = samples.template(256, 256, seed=31), samples.mask(256, 256, 0.2, "box", seed=31)

    def x(temporal=None, **kw):
        return denoise_inputs(pre(png(tpl), png(mask), parse_params(settings, "a hat", steps=STEPS,
                                                                     temporal=temporal, **kw)))

    step_mask_json = '{"policy": "steps", "steps": [0, 1, 2, 4, 6]}'
    rec = run_job(eng, x(step_mask_json, register=True))
    rt.flush()
    assert rec.cache.status == "record" and rec.temporal.info()["temporal_steps"] == "C" * STEPS
    assert "template run" in rec.temporal.info()["temporal_note"]
    hit = run_job(eng, x())
    zero = run_job(eng, x('{"policy": "fbcache", "threshold": 0}'))
    reuse = run_job(eng, x(step_mask_json))
    assert [j.cache.status for j in (hit, zero, reuse)] == ["hit"] * 3
    assert torch.equal(torch.from_numpy(zero.result()), torch.from_numpy(hit.result()))
    assert reuse.temporal.info()["temporal_steps"] == "CCCRCRCR"
    unmasked = ~np.asarray(x().token_mask, bool)
    assert np.array_equal(reuse.result()[unmasked], hit.result()[unmasked])
    assert not np.array_equal(reuse.result()[~unmasked], hit.result()[~unmasked])
    together = _run(eng, [x(), x(step_mask_json), x('{"policy": "fbcache", "threshold": 0.3}')])
    for job, alone in zip(together, [hit, reuse]):
        np.testing.assert_allclose(job.result(), alone.result(), atol=atol(settings, 1e-5), rtol=0)


def test_a_hit_on_a_reused_step_loads_no_rows_of_its_skipped_blocks(cached, settings, monkeypatch):
    """The loader is not asked for the skipped blocks' cached rows (the last middle block's output rows excepted:
    the next reader takes the unmasked ones from them)."""
    pre, eng, rt = cached
    tpl, mask = samples.template(256, 256, seed=32), samples.mask(256, 256, 0.2, "box", seed=32)

    def x(temporal=None, **kw):
        return denoise_inputs(pre(png(tpl), png(mask), parse_params(settings, "a hat", steps=STEPS,
                                                                     temporal=temporal, **kw)))

    run_job(eng, x(register=True))
    rt.flush()
    loaded = []
    load = rt.loader.load
    monkeypatch.setattr(rt.loader, "load", lambda jc, step, b, kind, **kw: (loaded.append((step, b, kind)),
                                                                            load(jc, step, b, kind, **kw))[1])
    job = run_job(eng, x('{"policy": "steps", "steps": [0, 1, 2, 4, 6]}'))
    assert job.cache.status == "hit" and job.temporal.info()["temporal_steps"] == "CCCRCRCR"
    tail = len(job.cache.modes) - 1
    for step in (3, 5, 7):
        got = {(b, kind) for s, b, kind in loaded if s == step}
        assert {b for b, _ in got} <= {0, tail} and (tail, "y") in got, got
    assert {b for s, b, _ in loaded if s == 2} == set(range(tail + 1))


@pytest.mark.parametrize("text,words", [
    ('{"policy": "nope"}', '"policy" must be one of'),
    ('{"policy": "fbcache", "threshold": NaN}', '"threshold" must be a number from 0 to 1'),
    ('{"policy": "fbcache", "threshold": -0.1}', '"threshold" must be a number from 0 to 1'),
    ('{"policy": "fbcache"}', 'needs "threshold"'),
    ('{"policy": "steps", "steps": [0, 9]}', '"steps" holds 9, outside 0 to 7'),
    ('{"policy": "steps", "steps": [1, 2]}', "must include step 0"),
    ('{"policy": "taylorseer", "order": 3, "threshold": 0.1}', '"order" must be a whole number from 1 to 2'),
    ('{"policy": "fbcache", "threshold": 0.1, "fn": 2}', "unknown fn"),
    ("[1, 2]", "must be a JSON object"), ("{", "is not valid JSON")])
def test_bad_values_are_refused_naming_the_field(settings, text, words):
    with pytest.raises(InvalidInput) as e:
        parse_params(settings, "x", steps=STEPS, temporal=text)
    assert e.value.field == "TEMPORAL" and words in str(e.value), str(e.value)
    assert "object at 0x" not in str(e.value)


def test_a_policy_the_model_cannot_take_fails_its_request_alone(runner, inputs):
    """fn + bn must leave a middle block (the tiny model has 4): refused at admission, the batch-mate goes on."""
    eng = DenoiseEngine(runner, max_batch=2)
    errors = []
    try:
        bad = DenoiseJob(replace(inputs(), temporal={"policy": "dbcache", "threshold": 0.1, "fn": 2, "bn": 2}),
                         on_error=lambda j, e: errors.append(e))
        good = replace(inputs(), temporal={"policy": "fbcache", "threshold": 0.3})
        eng.submit(bad)
        job = run_job(eng, good)
    finally:
        eng.shutdown()
    assert job.done and len(errors) == 1 and isinstance(errors[0], InvalidInput)
    assert errors[0].field == "TEMPORAL" and "4 blocks" in str(errors[0])


def test_server_default_applies_and_a_request_can_turn_it_off(settings):
    s = replace(settings, temporal='{"policy": "fbcache", "threshold": 0.1}')
    assert parse_params(s, "x").temporal.policy == "fbcache"
    assert not parse_params(s, "x", temporal='{"policy": "off"}').temporal.on
    with pytest.raises(InvalidInput, match="MASKEDIT_TEMPORAL"):
        parse_params(replace(settings, temporal='{"policy": "x"}'), "x")


def test_step_mask_helper_and_computed_fraction():
    m = step_mask(10, 0.6)
    assert len(m) == 6 and m[0] == 0 and m == sorted(set(m))
    spec = parse({"policy": "steps", "steps": m, "fn": 1, "bn": 1}, 10)
    assert computed_fraction(spec, 10, 12) == pytest.approx((6 + 4 * 2 / 12) / 10)
    with pytest.raises(TemporalSpecError):
        parse({"policy": "steps"}, 10)


def test_reused_steps_do_not_run_the_middle_blocks(runner, inputs):
    """The first block runs every step; the middle ones only on computed steps (their attention is never called
    on a reused step), for the reusing row only when it shares the call with a plain one."""
    tr = runner.transformer
    rows = {"first": [], "middle": []}
    hooks = [tr.transformer_blocks[0].attn.register_forward_pre_hook(
                 lambda m, a, k: rows["first"].append(k["hidden_states"].shape[0]), with_kwargs=True),
             tr.single_transformer_blocks[0].attn.register_forward_pre_hook(
                 lambda m, a, k: rows["middle"].append(k["hidden_states"].shape[0]), with_kwargs=True)]
    eng = DenoiseEngine(runner, max_batch=2)
    try:
        run_job(eng, replace(inputs(), temporal={"policy": "steps", "steps": [0, 1, 2, 4, 6]}))
        assert rows == {"first": [1] * STEPS, "middle": [1] * 5}
        rows["first"].clear(), rows["middle"].clear()
        jobs = [DenoiseJob(inputs()), DenoiseJob(replace(inputs(), temporal={"policy": "steps",
                                                                             "steps": [0, 1, 2, 4, 6]}))]
        for j in jobs:
            runner.prepare(j)
        while not all(j.done for j in jobs):
            runner.step(jobs)
        assert rows["first"] == [2] * STEPS and rows["middle"] == [2, 2, 2, 1, 2, 1, 2, 1]
    finally:
        eng.shutdown()
        for h in hooks:
            h.remove()


def test_a_negative_call_has_its_own_stream_committed_with_the_step():
    """A request whose family makes a negative prompt's call (``temporal_negative_call``) gets a second state at
    admission; ``negative`` gives that call a context of plain rows carrying its stream only (None where no row has
    one); ``commit`` records both streams, only for a step that succeeded; EDIT_INFO names both."""
    from types import SimpleNamespace

    from maskedit import temporal

    hooks = SimpleNamespace(blocks=[None] * 4)
    family = SimpleNamespace(temporal_reuse=True, temporal_hooks=lambda tr: hooks, pipeline_class_name="X",
                             temporal_negative_call=lambda job: job.guided)
    runner = SimpleNamespace(family=family, transformer=None)
    jobs = [SimpleNamespace(inputs=SimpleNamespace(temporal={"policy": "fbcache", "threshold": 0}, steps=4),
                            cache=None, step_index=0, guided=g) for g in (True, False)]
    for j in jobs:
        temporal.admit(runner, j)
    guided, plain = jobs
    assert guided.temporal.uncond is not None and guided.temporal.uncond is not guided.temporal
    assert plain.temporal.uncond is None
    ctx = temporal.attach(None, jobs, lambda: hooks)
    neg = ctx.temporal.negative()
    assert neg.rows == [None, None] and neg.temporal.stream == temporal.UNCOND
    assert neg.temporal.rows[0].state is guided.temporal.uncond and neg.temporal.rows[1] is None
    assert ctx.temporal.negative([1]) is None  # the unguided row has no negative call
    assert ctx.temporal.negative([0]).temporal.rows[0].state is guided.temporal.uncond
    assert guided.temporal.uncond.outcomes == []  # a step that fails commits nothing; its retry attaches afresh
    ctx = temporal.attach(None, jobs, lambda: hooks)
    for j in jobs:
        j.step_index += 1  # the family's step advanced them
    temporal.commit(ctx, jobs)
    assert guided.temporal.outcomes == guided.temporal.uncond.outcomes == ["C"] and plain.temporal.outcomes == ["C"]
    info = guided.temporal.info()
    assert info["temporal_uncond_steps"] == "C" and info["temporal_uncond_reused_steps"] == 0
    assert info["temporal_computed_fraction"] == 1.0 and "temporal_uncond_steps" not in plain.temporal.info()
