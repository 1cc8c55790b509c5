"""Shared helpers of the flux_controlnet tests: the tiny model and its ControlNet library, stand-ins for the
engine's runner and jobs (as ``klein_util``), the step loops with and without a cache runtime, requests through the
engine one by one and concurrently."""

import json
import threading
from types import SimpleNamespace

import numpy as np
import torch
from maskedit_common.controls import ControlSpec
from diffusers import FluxControlNetInpaintPipeline
from PIL import Image

from maskedit import imaging
from maskedit.cache.store import ActivationStore
from maskedit.controlnets.job import ActiveControl
from maskedit.controlnets.library import ControlNetLibrary
from maskedit.families import family_for
from maskedit.families.flux_controlnet.tiny import build

MAX_SEQ = 64
GUIDANCE = 3.5


def settings(model_dir=None):
    return SimpleNamespace(max_sequence_length=MAX_SEQ, torch_device="cpu", dtype="float32", model_dir=model_dir)


def params(prompt="a red hat", seed=0, template_seed=None, steps=3, controls=()):
    return SimpleNamespace(prompt=prompt, seed=seed, template_seed=seed if template_seed is None else template_seed,
                           steps=steps, guidance=GUIDANCE, controls=tuple(controls))


def template(w=256, h=256, seed=0):
    rs = np.random.RandomState(seed)
    base = rs.rand(h // 32, w // 32, 3)
    return Image.fromarray((np.kron(base, np.ones((32, 32, 1))) * 255).astype(np.uint8))


def edges(w=256, h=256, seed=0):
    """A control map: white lines on black, as an edge or line-art map looks."""
    rs = np.random.RandomState(seed)
    m = np.zeros((h, w, 3), np.uint8)
    for _ in range(6):
        if rs.rand() < 0.5:
            m[rs.randint(h), :] = 255
        else:
            m[:, rs.randint(w)] = 255
    return Image.fromarray(m)


def box_mask(w=256, h=256, box=(64, 80, 160, 200)):
    m = np.zeros((h, w), np.uint8)
    y0, x0, y1, x1 = box
    m[y0:y1, x0:x1] = 255
    return m


def prepared(family, pipe, img, mask, p, control_images=()):
    """The pre-processing stage's tensors (``Preprocessor.__call__``'s family calls) and the request's controls."""
    w, h = img.size
    image = pipe.image_processor.preprocess(img, height=h, width=w).to(dtype=torch.float32)
    mask_t = pipe.mask_processor.preprocess(Image.fromarray(mask), height=h, width=w)
    tokens = imaging.token_mask(mask_t[0, 0].numpy(), family.geometry().patch)
    out = family.prepare(pipe, dict(pipe.scheduler.config), image, mask_t, tokens, w, h, p, settings())
    images = [family.prepare_control_image(pipe, c, w, h, settings()) for c in control_images]
    return out, tokens, images


def runner(family, pipe):
    return SimpleNamespace(transformer=pipe.transformer, device=torch.device("cpu"), dtype=torch.float32,
                           scheduler_config=dict(pipe.scheduler.config), geometry=family.geometry(),
                           library=ControlNetLibrary(family.model_dir / "controlnets", family,
                                                     settings(family.model_dir)))


def tiny_model(path, seed):
    """The seeded ``flux-cn-tiny`` model (with its ControlNet library) built at ``path``, loaded: the family, the stock
    pipeline its stages use (no ControlNet: the family loads its own) and a runner over its transformer."""
    d = build(path, "flux-cn-tiny", seed=seed)
    family = family_for(d)
    pipe = FluxControlNetInpaintPipeline.from_pretrained(d, controlnet=None)
    pipe.set_progress_bar_config(disable=True)
    return family, pipe, runner(family, pipe)


def activation_store(d):
    """An activation store under ``d`` large enough that nothing is evicted."""
    return ActivationStore(d / "mem", d / "disk", 1 << 30, 1 << 30)


def job(run_, prep, tokens, images, specs, w, h, steps, key=None, register=False):
    """A denoise job as the runner admits it: its controls loaded from the library (``ModelRunner.load_controls``)."""
    np_ = lambda t: t.detach().numpy()  # noqa: E731
    inputs = SimpleNamespace(latents=np_(prep.latents), cond=np_(prep.cond), prompt_embeds=np_(prep.prompt_embeds),
                             pooled_embeds=np_(prep.pooled_embeds), token_mask=tokens, model_w=w, model_h=h,
                             steps=steps, guidance=GUIDANCE, cache_key=key, register=register)
    controls = tuple(ActiveControl(s, run_.library.load(s, i, run_.transformer), img)
                     for i, (s, img) in enumerate(zip(specs, images)))
    return SimpleNamespace(inputs=inputs, latents=None, tensors=None, scheduler=None, step_index=0, cache=None,
                           steps=steps, controls=controls)


def edit(family, pipe, run_, img, mask, specs=(), control_images=(), seed=0, steps=3, prompt="a red hat", key=None,
         register=False):
    """A job for the request; ``key`` and ``register`` as pre-processing sets them for the cache runtime."""
    p = params(prompt, seed=seed, steps=steps, controls=specs)
    prep, tokens, images = prepared(family, pipe, img, mask, p, control_images)
    return job(run_, prep, tokens, images, specs, *img.size, steps, key=key, register=register)


def denoise(family, run_, jobs, runtime=None):
    """Step ``jobs`` (one prepared group) to the end; with ``runtime`` deciding, loading and recording at each step as
    the engine drives it."""
    with torch.no_grad():
        while jobs[0].step_index < jobs[0].steps:
            family.step(run_, jobs, None if runtime is None else runtime.context(jobs))
            if runtime is not None:
                runtime.after_step(jobs)


def run(family, run_, jobs):
    """Step ``jobs`` (one group) to the end."""
    for j in jobs:
        family.prepare_job(run_, j)
    denoise(family, run_, jobs)
    return [j.latents for j in jobs]


def admit(family, run_, runtime, jobs):
    """Prepare ``jobs`` and let ``runtime`` decide each one's cache status (hit, record, off)."""
    for j in jobs:
        family.prepare_job(run_, j)
        runtime.admit(j)


def finish(runtime, jobs):
    """End ``jobs`` as succeeded and write what they recorded to the store."""
    for j in jobs:
        runtime.finish(j, True)
    runtime.flush()


def cached(family, run_, runtime, jobs):
    """``jobs`` denoised together with ``runtime`` deciding, loading and recording, as the engine drives them."""
    admit(family, run_, runtime, jobs)
    denoise(family, run_, jobs, runtime)
    finish(runtime, jobs)
    return [j.latents for j in jobs]


def engine_inputs(ed, img, mask, asks, seed, steps=3, prompt="a blue shirt"):
    """``asks`` ((controls, control PNGs) per request, seeds from ``seed`` on) through ``ed``'s pre-processing."""
    from maskedit.local import denoise_inputs
    from maskedit.params import parse_params
    from tests.conftest import png

    out = []
    for i, (controls, images) in enumerate(asks):
        p = parse_params(ed.settings, prompt, seed=seed + i, steps=steps, controls=json.dumps(controls))
        out.append(denoise_inputs(ed.pre(png(img), png(mask), p, images)))
    return out


def concurrently(engine, inputs):
    """The results of ``inputs`` submitted to ``engine`` at once, one thread each (the engine batches them)."""
    from maskedit.local import run_job

    results = [None] * len(inputs)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run_job(engine, inputs[i]).result()))
               for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def spec(name, scale=1.0, start=0.0, end=1.0, mode=None):
    return ControlSpec(name, scale, start, end, mode)


def one_batch(runner, inputs, timeout: float = 180.0):
    """``inputs`` through one engine on ``runner`` as one batch; the jobs and each one's error (None if it ended)."""
    from maskedit.denoise import DenoiseJob
    from maskedit.engine import DenoiseEngine

    eng = DenoiseEngine(runner, max_batch=len(inputs))
    ended, errors, finished = [], {}, threading.Event()

    def end(job, e=None):
        errors[job.id] = e
        ended.append(job)
        if len(ended) == len(inputs):
            finished.set()
    jobs = [DenoiseJob(x, on_done=end, on_error=end) for x in inputs]
    try:
        for j in jobs:
            eng.submit(j)
        assert finished.wait(timeout)
    finally:
        eng.shutdown()
    return jobs, [errors[j.id] for j in jobs]
