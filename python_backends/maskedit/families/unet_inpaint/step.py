"""One denoising step of SD 2 / SDXL inpainting requests: the UNet call of ``ModelRunner`` for those families.

Mirrors the pipelines' loop body (``StableDiffusion(XL)InpaintPipeline.__call__``): each request's latents doubled
for classifier-free guidance, scaled by its own scheduler, concatenated with its mask and masked-image latents; one
UNet call for the whole group (every request with its own timestep, text and SDXL conditioning rows); then per
request the guidance combination and its scheduler's step. Requests of one resolution share a call (a UNet's
convolutions cannot pack different sizes into one batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_inpaint import rescale_noise_cfg

from ...errors import InvalidInput
from .cache import UNetCacheHooks, per_unet_row
from .controlnet import LateResiduals, collect_residuals, start_residuals
from .prepare import cfg_rows, from_rows, make_unet_scheduler


@dataclass
class UNetTensors:
    """A request's conditioning on the device, made once when it is admitted."""

    cond: torch.Tensor  # (1, N, 5): latent-size mask and masked-image latents, one row per latent pixel
    prompt_embeds: torch.Tensor  # (R, 77, D): per guidance row (negative first)
    pooled: torch.Tensor | None  # SDXL: (R, P + T) pooled text and time ids per guidance row


def prepare_job(runner, job) -> None:
    """Admit an SD 2 / SDXL request: its tensors on the device."""
    x = job.inputs
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(runner.device, runner.dtype)  # noqa: E731
    r = cfg_rows(x.guidance)
    text = t(x.prompt_embeds)
    if text.shape[0] % r:
        raise InvalidInput(f"has {text.shape[0]} rows, not a multiple of the {r} guidance rows", "PROMPT_EMBEDS")
    job.latents = t(x.latents).unsqueeze(0)  # (1, N, 4): rows, as the engine and the cache address tokens
    job.tensors = UNetTensors(cond=t(x.cond).unsqueeze(0), prompt_embeds=text.unflatten(0, (r, -1)),
                              pooled=t(x.pooled_embeds).unflatten(0, (r, -1)) if _xl(runner.transformer) else None)
    job.scheduler = make_unet_scheduler(runner.scheduler_config, x.steps, runner.device)


def _xl(unet) -> bool:
    return unet.config.addition_embed_type == "text_time"  # SDXL: pooled text and time ids condition the UNet


def _time_ids_len(unet, row: int) -> int:
    """How many SDXL time ids end each pooled row: the add-embedding reads ``time_dim * T + P`` features and the
    row holds ``P + T`` numbers."""
    time_dim = unet.config.addition_time_embed_dim
    return (unet.add_embedding.linear_1.in_features - row) // (time_dim - 1)


def cached_controls(caches, job, r: int) -> dict:
    """``{"cached": run}`` where ``job``'s ControlNets are cached (``maskedit.cache.controlnet``): ``run(control,
    call)`` makes the ControlNet call with the control's cache view (a template run records its rows, a hit computes
    its masked rows), one view per guidance row as for the UNet. Empty where they are not (nothing cached, or the
    ``controlnet`` Triton model computes them: such requests run uncached)."""
    if caches is None or not caches.rows(job):
        return {}

    def run(control, call):
        got = caches.view(job, next(k for k, c in enumerate(job.controls) if c is control))
        if got is None:
            return call()
        hooks, view = got
        return hooks.run(per_unet_row(view, r), call)

    return {"cached": run}


@torch.no_grad()
def step_group(runner, group: list, ctx=None) -> None:
    """Advance ``group`` (same resolution, same guidance rows, same text length) by one step."""
    unet = runner.transformer
    x0 = group[0].inputs
    h, w = x0.model_h // runner.geometry.patch, x0.model_w // runner.geometry.patch
    r = group[0].tensors.prompt_embeds.shape[0]
    timesteps = [j.scheduler.timesteps[j.step_index] for j in group]
    rows, ts, scaled = [], [], []
    for job, t in zip(group, timesteps):
        lat = from_rows(job.latents, h, w)
        lat = job.scheduler.scale_model_input(torch.cat([lat] * r) if r > 1 else lat, t)
        scaled.append(lat)
        cond = from_rows(job.tensors.cond, h, w).expand(r, -1, -1, -1)
        rows.append(torch.cat([lat, cond], dim=1))
        ts.append(t.reshape(1).expand(r))
    sample = torch.cat(rows)
    text = torch.cat([j.tensors.prompt_embeds for j in group])
    added = None
    if _xl(unet):
        pooled = torch.cat([j.tensors.pooled for j in group])
        n_ids = _time_ids_len(unet, pooled.shape[1])
        added = {"text_embeds": pooled[:, :-n_ids], "time_ids": pooled[:, -n_ids:]}
    down, mid = None, None
    if any(j.controls for j in group):  # the ControlNets see each request's latents before the mask channels
        caches = ctx.controls if ctx is not None else None
        per_job = [{"sample": lat, "timestep": t.reshape(1).expand(r).to(runner.device),
                    "encoder_hidden_states": j.tensors.prompt_embeds,
                    "added_cond_kwargs": None if added is None else
                    {k: v[i * r:(i + 1) * r] for k, v in added.items()},
                    **cached_controls(caches, j, r)}
                   for i, (j, lat, t) in enumerate(zip(group, scaled, timesteps))]
        provider, t0 = runner.control_provider, time.perf_counter()
        pending = start_residuals(provider, group, per_job)  # through Triton: in flight while the UNet starts
        if any(p is not None for p in pending):
            late = LateResiduals(lambda: collect_residuals(provider, group, pending, t0), unet, sample.shape[0], h, w,
                                 sample.device, sample.dtype)
            down, mid = late.down, late.mid
    forward = lambda: unet(sample, torch.cat(ts).to(runner.device), encoder_hidden_states=text,  # noqa: E731
                           added_cond_kwargs=added, down_block_additional_residuals=down,
                           mid_block_additional_residual=mid, return_dict=False)[0]
    if ctx is not None and ctx.temporal is not None:  # temporal reuse: the deep features (``temporal.py``)
        from .temporal import UNetTemporalHooks

        forward = (lambda f: lambda: UNetTemporalHooks.of(unet).run(ctx.temporal, f))(forward)
    if ctx is not None and any(v is not None for v in ctx.rows):
        noise = UNetCacheHooks.of(unet).run(per_unet_row(ctx, r), forward)
    else:
        noise = forward()
    for i, (job, t) in enumerate(zip(group, timesteps)):
        pred = noise[i * r:(i + 1) * r]
        if r > 1:
            uncond, cond_pred = pred.chunk(2)
            pred = uncond + job.inputs.guidance * (cond_pred - uncond)
            rescale = getattr(job.inputs, "guidance_rescale", 0.0)
            if rescale > 0:  # SDXL's guidance_rescale (its family refuses it for SD 2, whose pipeline lacks it)
                pred = rescale_noise_cfg(pred, cond_pred, guidance_rescale=rescale)
        lat = job.scheduler.step(pred, t, from_rows(job.latents, h, w), return_dict=False)[0]
        job.latents = lat.permute(0, 2, 3, 1).reshape(1, h * w, -1)
        job.step_index += 1
