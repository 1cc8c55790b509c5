"""Shared helpers of the qwen_image_edit tests: the tiny model (built once per session), stand-ins for the engine's
runner and jobs, the stock pipeline's call."""

from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from maskedit import imaging
from maskedit.families.qwen_image_edit import QwenImageEditFamily
from maskedit.families.qwen_image_edit.tiny import build

SIZE = 1024  # the stock pipeline always works at about 1024 x 1024
_BUILT: dict = {}


def tiny_model(tmp_path_factory):
    """(family, stock pipeline) of the tiny preset, built once per test session."""
    if "tiny" not in _BUILT:
        d = build(tmp_path_factory.getbasetemp() / "qwen-edit-tiny", "qwen-edit-tiny", seed=0)
        _BUILT["tiny"] = (QwenImageEditFamily(d), load(d))
    return _BUILT["tiny"]


def load(model_dir):
    from diffusers import QwenImageEditInpaintPipeline

    pipe = QwenImageEditInpaintPipeline.from_pretrained(model_dir, **QwenImageEditFamily(model_dir).pipeline_kwargs())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def settings(resolution=SIZE):
    return SimpleNamespace(max_sequence_length=1024, torch_device="cpu", dtype="float32", resolution=resolution,
                           prompt_cache_bytes=64 << 20)


def params(prompt="a red hat", seed=0, template_seed=None, steps=3, guidance=1.0, negative_prompt=""):
    return SimpleNamespace(prompt=prompt, seed=seed, template_seed=seed if template_seed is None else template_seed,
                           steps=steps, guidance=guidance, negative_prompt=negative_prompt)


def template(w=SIZE, h=SIZE, seed=0):
    rs = np.random.RandomState(seed)
    base = rs.rand(h // 64, w // 64, 3)
    return Image.fromarray((np.kron(base, np.ones((64, 64, 1))) * 255).astype(np.uint8))


def box_mask(w=SIZE, h=SIZE, box=(256, 320, 640, 768)):
    m = np.zeros((h, w), np.uint8)
    y0, x0, y1, x1 = box
    m[y0:y1, x0:x1] = 255
    return m


def prepared(family, pipe, img, mask, p, s=None):
    """The family's tensors for an edit, as the Preprocessor makes them (its model size, processors, token mask)."""
    s = s or settings()
    w, h = family.model_size(*img.size, s)
    image = pipe.image_processor.preprocess(img, height=h, width=w)
    mask_t = pipe.mask_processor.preprocess(Image.fromarray(mask), height=h, width=w)
    tokens = imaging.token_mask(mask_t[0, 0].numpy(), family.geometry().patch)
    out = family.prepare(pipe, dict(pipe.scheduler.config), image, mask_t, tokens, w, h, p, s)
    return out, tokens, (w, h)


def runner(family, pipe):
    return SimpleNamespace(transformer=pipe.transformer, device=torch.device("cpu"), dtype=torch.float32,
                           scheduler_config=dict(pipe.scheduler.config), geometry=family.geometry())


def job(prep, tokens, size, steps, guidance=1.0):
    np_ = lambda t: t.detach().numpy()  # noqa: E731
    w, h = size
    inputs = SimpleNamespace(latents=np_(prep.latents), cond=np_(prep.cond), prompt_embeds=np_(prep.prompt_embeds),
                             pooled_embeds=np_(prep.pooled_embeds), token_mask=tokens, model_w=w, model_h=h,
                             steps=steps, guidance=guidance, cache_key=None, register=False)
    return SimpleNamespace(inputs=inputs, latents=None, tensors=None, scheduler=None, step_index=0, cache=None,
                           steps=steps)


def make(family, pipe, img, mask, steps=3, key=None, register=False, **kw):
    prep, tokens, size = prepared(family, pipe, img, mask, params(steps=steps, **kw))
    j = job(prep, tokens, size, steps, kw.get("guidance", 1.0))
    j.inputs.cache_key, j.inputs.register = key, register
    return j


def run(family, run_, jobs, ctx_for=None):
    """Step ``jobs`` (one group) to the end; ``ctx_for(jobs)`` gives each step's cache context (or None)."""
    for j in jobs:
        family.prepare_job(run_, j)
    assert len({family.group_key(j) for j in jobs}) == 1, "the jobs must share a call"
    with torch.no_grad():
        while jobs[0].step_index < jobs[0].steps:
            family.step(run_, jobs, ctx_for(jobs) if ctx_for is not None else None)
    return [j.latents for j in jobs]


def stock(pipe, img, mask, prompt, seed, steps, output_type="latent", guidance=1.0, negative_prompt=None):
    return pipe(image=img, prompt=prompt, negative_prompt=negative_prompt, mask_image=Image.fromarray(mask),
                strength=1.0, num_inference_steps=steps, true_cfg_scale=guidance,
                generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type).images
