"""The Flux ControlNet inpainting denoise step for a group of requests, and a request's tensors on the device.

One step of ``FluxControlNetInpaintPipeline``'s loop for every request of the group: the ControlNets' residuals
(``maskedit.controlnets.flux``: batched per ControlNet over the requests using it), one transformer call with them
(``controlnet_block_samples`` / ``controlnet_single_block_samples``), each request's own scheduler step, then the
pipeline's blend: ``latents = (1 - m) * scale_noise(image_latents, t_next, noise) + m * latents`` (after the last
step the clean image latents), so the region outside the mask follows the template.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FluxControlNetInpaintPipeline

from ...cache.flux import FluxCacheHooks
from ...cache.modes import StepContext
from ...controlnets import flux as R
from ...controlnets import flux_remote
from ...controlnets.flux_remote import config_of
from ...errors import InvalidInput
from ...schedule import make_scheduler
from .. import true_cfg
from ..latent_blend import step_and_blend
from .prepare import control_latents, split_cond


@dataclass
class ControlTensors:
    """A request's conditioning on the device, made once when it is admitted."""

    cond: torch.Tensor  # (1, N, 3C): image latents | noise | blend mask
    controls: tuple  # ((ActiveControl, mode index or None, (1, N, C) control latents), ...) in control order
    prompt_embeds: torch.Tensor  # (1, txt, D)
    pooled: torch.Tensor  # (1, D_pooled)
    img_ids: torch.Tensor  # (N, 3)
    txt_ids: torch.Tensor  # (txt, 3)
    guidance: torch.Tensor | None  # (1,) when the transformer embeds guidance
    net_guidance: torch.Tensor | None = None  # (1,) for ControlNets embedding guidance (as stock: always given)
    structure: tuple = (None, None)  # its merged residual lists' (double, single) lengths (``flux.structure``)
    negative: tuple | None = None  # TRUE_CFG_SCALE > 1: its negative text (1, txt, D) and pooled (1, D_pooled)


def prepare_job(runner, job, pixels_per_token: int, vae_config: dict, mode_index) -> None:
    """``job.controls``: its ``ActiveControl``s (loaded ControlNet, or None when placed in the ``controlnet`` model;
    packed posterior on the device; spec); ``mode_index(spec, config)``: a union control's mode index (None for the
    others)."""
    x = job.inputs
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(runner.device, runner.dtype).unsqueeze(0)  # noqa
    job.latents = t(x.latents)
    c = job.latents.shape[-1]
    cond = t(x.cond)
    eps = split_cond(cond, c)[3]
    active = tuple(job.controls)
    if (0 if eps is None else eps.shape[-2]) != len(active):  # a request's own tensors disagree: refuse it alone
        raise InvalidInput(f"carries sample noise for {0 if eps is None else eps.shape[-2]} control images and the "
                           f"request has {len(active)} controls", "COND")
    configs = [config_of(runner, a, k) for k, a in enumerate(active)]
    controls = tuple((a, mode_index(a.spec, cfg), control_latents(vae_config, a.image.unsqueeze(0), eps[..., k, :]))
                     for k, (a, cfg) in enumerate(zip(active, configs)))
    grid_h, grid_w = x.model_h // pixels_per_token, x.model_w // pixels_per_token
    embeds_guidance = bool(runner.transformer.config.guidance_embeds)
    text, pooled, negative = true_cfg.split_negative(x, t(x.prompt_embeds), t(x.pooled_embeds))
    job.tensors = ControlTensors(
        cond=cond[..., :3 * c], controls=controls, prompt_embeds=text, pooled=pooled, negative=negative,
        img_ids=FluxControlNetInpaintPipeline._prepare_latent_image_ids(1, grid_h, grid_w, runner.device,
                                                                         runner.dtype),
        txt_ids=torch.zeros(text.shape[1], 3, device=runner.device, dtype=runner.dtype),
        guidance=torch.full([1], x.guidance, device=runner.device, dtype=torch.float32) if embeds_guidance else None,
        net_guidance=torch.full([1], x.guidance, device=runner.device, dtype=torch.float32),
        structure=R.structure_of(configs))
    job.scheduler = make_scheduler(runner.scheduler_config, x.steps, x.latents.shape[0], runner.device)


@torch.no_grad()
def step(runner, group: list, ctx) -> None:
    """One step for ``group`` (one resolution, equal text length): residuals, the transformer call(s), each
    request's scheduler step and blend."""
    tr = runner.transformer
    timesteps = [j.scheduler.timesteps[j.step_index] for j in group]
    latents = torch.cat([j.latents for j in group])
    timestep = torch.stack([t.to(latents.device) for t in timesteps]).to(latents.dtype) / 1000
    cat = lambda key: torch.cat([getattr(j.tensors, key) for j in group])  # noqa: E731
    guidance = cat("guidance") if group[0].tensors.guidance is not None else None
    pooled, text = cat("pooled"), cat("prompt_embeds")
    jt = group[0].tensors
    # ControlNet calls through the activation cache (recording / masked rows: ``maskedit.cache.controlnet``); placed in
    # the ``controlnet`` model they are in flight while the transformer starts (``flux_remote``)
    run = None if ctx is None or ctx.controls is None else (
        lambda net, uses, call: ctx.controls.run(net, group, uses, call))
    splits, lists = flux_remote.step_lists(runner, group, lambda j: j.tensors.controls, latents, timestep,
                                           cat("net_guidance"), pooled, text, jt.txt_ids, jt.img_ids, run)
    pred = torch.empty_like(latents)
    for n, idx in enumerate(splits):
        sel = torch.tensor(idx, device=latents.device)
        double, single = lists(idx)
        forward = lambda: tr(  # noqa: E731
            hidden_states=latents[sel], timestep=timestep[sel],
            guidance=guidance[sel] if guidance is not None else None, pooled_projections=pooled[sel],
            encoder_hidden_states=text[sel], controlnet_block_samples=double,
            controlnet_single_block_samples=single, txt_ids=jt.txt_ids, img_ids=jt.img_ids,
            joint_attention_kwargs=None, return_dict=False, controlnet_blocks_repeat=False)[0]
        if ctx is None:
            pred[sel] = forward()
        else:  # the cache's views of this call's rows (the loader's look-ahead told once, by the first call)
            sub = StepContext([ctx.rows[i] for i in idx], ctx.packed, ctx.on_block if n == 0 else None,
                              temporal=ctx.temporal.subset(idx) if ctx.temporal is not None else None)
            pred[sel] = FluxCacheHooks.of(tr).run(sub, forward)
    # FluxInpaintPipeline's true CFG (requests without controls); the negative call reuses on its own stream
    true_cfg.apply(tr, group, pred, latents, timestep, guidance, jt.txt_ids, jt.img_ids, ctx, FluxCacheHooks.of)
    c = latents.shape[-1]
    for i, (job, t) in enumerate(zip(group, timesteps)):
        step_and_blend(job, pred[i:i + 1], t, *split_cond(job.tensors.cond, c)[:3])

