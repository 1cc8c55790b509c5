"""Shared helpers of the flux2_klein tests: the tiny model, stand-ins for the engine's runner and jobs."""

from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from maskedit import imaging
from maskedit.families.flux2_klein import Flux2KleinFamily

from .cache_util import run_cached

MAX_SEQ = 64


def load(model_dir):
    from diffusers import Flux2KleinInpaintPipeline

    pipe = Flux2KleinInpaintPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def settings():
    return SimpleNamespace(max_sequence_length=MAX_SEQ, torch_device="cpu", dtype="float32")


def params(prompt="a red hat", seed=0, template_seed=None, steps=3, guidance=1.0):
    return SimpleNamespace(prompt=prompt, seed=seed, template_seed=seed if template_seed is None else template_seed,
                           steps=steps, guidance=guidance)


def template(w=256, h=256, seed=0):
    rs = np.random.RandomState(seed)
    base = rs.rand(h // 32, w // 32, 3)
    return Image.fromarray((np.kron(base, np.ones((32, 32, 1))) * 255).astype(np.uint8))


def box_mask(w=256, h=256, box=(64, 80, 160, 200)):
    m = np.zeros((h, w), np.uint8)
    y0, x0, y1, x1 = box
    m[y0:y1, x0:x1] = 255
    return m


def prepared(family, pipe, img, mask, p):
    w, h = img.size
    image = pipe.image_processor.preprocess(img, height=h, width=w)
    mask_t = pipe.mask_processor.preprocess(Image.fromarray(mask), height=h, width=w)
    tokens = imaging.token_mask(mask_t[0, 0].numpy(), family.geometry().patch)
    out = family.prepare(pipe, dict(pipe.scheduler.config), image, mask_t, tokens, w, h, p, settings())
    return out, tokens


def runner(pipe):
    return SimpleNamespace(transformer=pipe.transformer, device=torch.device("cpu"), dtype=torch.float32,
                           scheduler_config=dict(pipe.scheduler.config))


def job(prep, tokens, w, h, steps):
    np_ = lambda t: t.detach().numpy()  # noqa: E731
    inputs = SimpleNamespace(latents=np_(prep.latents), cond=np_(prep.cond), prompt_embeds=np_(prep.prompt_embeds),
                             pooled_embeds=np_(prep.pooled_embeds), token_mask=tokens, model_w=w, model_h=h,
                             steps=steps, guidance=1.0, cache_key=None, register=False)
    return SimpleNamespace(inputs=inputs, latents=None, tensors=None, scheduler=None, step_index=0, cache=None,
                           steps=steps)


def run(family, run_, jobs, ctx_for=None):
    """Step ``jobs`` (one group) to the end; ``ctx_for(jobs)`` gives each step's cache context (or None)."""
    for j in jobs:
        family.prepare_job(run_, j)
    with torch.no_grad():
        while jobs[0].step_index < jobs[0].steps:
            ctx = ctx_for(jobs) if ctx_for is not None else None
            family.step(run_, jobs, ctx)
            if ctx is not None and hasattr(ctx, "after"):
                ctx.after()
    return [j.latents for j in jobs]


def cached(family, pipe, runtime, j):
    """``j`` denoised with ``runtime`` deciding, loading and recording, as the engine drives it."""
    return run_cached(family, runner(pipe), runtime, j)


def plain(family, pipe, j):
    return run(family, runner(pipe), [j])[0]


def stock(pipe, img, mask, prompt, seed, steps, output_type):
    return pipe(prompt=prompt, image=img, mask_image=Image.fromarray(mask), num_inference_steps=steps, strength=1.0,
                guidance_scale=1.0, max_sequence_length=MAX_SEQ, generator=torch.Generator("cpu").manual_seed(seed),
                output_type=output_type).images
