"""Shared helpers of the flux_kontext tests: the tiny model, requests as pre-processing makes them, the stock call."""

from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from .klein_util import box_mask, params, prepared, run, runner, settings, template  # noqa: F401  (shared)

MAX_SEQ = 64
GUIDANCE = 2.5


def load(model_dir):
    from diffusers import FluxKontextInpaintPipeline

    pipe = FluxKontextInpaintPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def job(family, pipe, img, mask, p, reference=None):
    """A job as the engine admits it (``DenoiseInputs``' fields), with ``reference`` (a PIL image) if given."""
    prep, tokens = prepared(family, pipe, img, mask, p)
    w, h = img.size
    ref, grids = None, ()
    if reference is not None:
        rows, grids = family.prepare_references(pipe, [reference], w, h, settings())
        ref = rows.detach().numpy()
    np_ = lambda t: t.detach().numpy()  # noqa: E731
    inputs = SimpleNamespace(latents=np_(prep.latents), cond=np_(prep.cond), prompt_embeds=np_(prep.prompt_embeds),
                             pooled_embeds=np_(prep.pooled_embeds), token_mask=tokens, model_w=w, model_h=h,
                             steps=p.steps, guidance=p.guidance, cache_key=None, register=False, reference=ref,
                             reference_grids=grids)
    return SimpleNamespace(inputs=inputs, latents=None, tensors=None, scheduler=None, step_index=0, cache=None,
                           steps=p.steps)


def stock(pipe, img, mask, prompt, seed, steps, output_type, reference=None, **kw):
    """``kw``: more of the pipeline's arguments (``true_cfg_scale``, ``negative_prompt``)."""
    w, h = img.size
    return pipe(prompt=prompt, image=img, mask_image=Image.fromarray(mask), image_reference=reference, height=h,
                width=w, max_area=w * h, _auto_resize=False, num_inference_steps=steps, strength=1.0,
                guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQ,
                generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kw).images


def kparams(prompt="make the hat red", seed=0, steps=3):
    return params(prompt, seed=seed, steps=steps, guidance=GUIDANCE)


__all__ = ["MAX_SEQ", "box_mask", "job", "load", "kparams", "run", "runner", "stock", "template", "np"]
