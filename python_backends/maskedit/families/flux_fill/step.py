"""The Flux Fill denoise step for a group of requests, and a request's tensors on the device.

Requests of one resolution share a plain Diffusers call; requests of different resolutions share one *packed*
call (rows padded to the longest, every row computed through the gathered path of the masked-block hooks with its
own token count and rotary tables), so a running batch never splits into one transformer call per resolution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.pipelines.flux.pipeline_flux_fill import FluxFillPipeline

from ...cache.modes import FULL, StepContext
from ...cache.rows import RowView
from ...controlnets import flux as R
from ...controlnets import flux_remote
from ...controlnets.flux_remote import config_of
from ...schedule import make_scheduler
from .cache import FluxCacheHooks


@dataclass
class FluxTensors:
    """A request's conditioning on the device, made once when it is admitted."""

    cond: torch.Tensor  # (1, tokens, C_cond): masked-image latents and mask
    prompt_embeds: torch.Tensor  # (1, txt, D)
    pooled: torch.Tensor  # (1, D_pooled)
    img_ids: torch.Tensor  # (tokens, 3) token grid ids
    txt_ids: torch.Tensor  # (txt, 3)
    guidance: torch.Tensor | None  # (1,) when the model embeds guidance
    rope: tuple | None = None  # its own rotary tables, made the first time it joins a packed call
    # ControlNets (our extension, docs/controlnet_flux.md): ((ActiveControl, mode index or None, (1, tokens, C)
    # control latents), ...) in control order
    controls: tuple = ()
    structure: tuple = (None, None)  # its merged residual lists' (double, single) lengths (``flux.structure``)


def prepare_job(runner, job, pixels_per_token: int) -> None:
    x = job.inputs
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(runner.device, runner.dtype).unsqueeze(0)  # noqa
    job.latents = t(x.latents)
    # Token grid ids, as FluxFillPipeline._prepare_latent_image_ids builds them.
    grid_h, grid_w = x.model_h // pixels_per_token, x.model_w // pixels_per_token
    embeds_guidance = bool(runner.transformer.config.guidance_embeds)
    active = tuple(getattr(job, "controls", ()))
    configs = [config_of(runner, a, k) for k, a in enumerate(active)]  # placed in the controlnet model: no weights
    job.tensors = FluxTensors(
        cond=t(x.cond), prompt_embeds=t(x.prompt_embeds), pooled=t(x.pooled_embeds),
        img_ids=FluxFillPipeline._prepare_latent_image_ids(1, grid_h, grid_w, runner.device, runner.dtype),
        txt_ids=torch.zeros(x.prompt_embeds.shape[0], 3, device=runner.device, dtype=runner.dtype),
        guidance=torch.full([1], x.guidance, device=runner.device, dtype=torch.float32) if embeds_guidance else None,
        controls=tuple((a, R.mode_index(a.spec.mode, cfg) if R.is_union(cfg) else None, a.image.unsqueeze(0))
                       for a, cfg in zip(active, configs)),
        structure=R.structure_of(configs))
    job.scheduler = make_scheduler(runner.scheduler_config, x.steps, x.latents.shape[0], runner.device)


@torch.no_grad()
def step(runner, group: list, ctx: StepContext | None) -> None:
    """One transformer call for ``group`` (equal text length), then each request's scheduler step."""
    transformer = runner.transformer
    timesteps = [j.scheduler.timesteps[j.step_index] for j in group]
    tokens = [j.latents.shape[1] for j in group]
    packed = len({(j.inputs.model_h, j.inputs.model_w) for j in group}) > 1
    longest = group[tokens.index(max(tokens))]
    pad = (lambda x: F.pad(x, (0, 0, 0, max(tokens) - x.shape[1]))) if packed else (lambda x: x)
    cat = lambda key: torch.cat([getattr(j.tensors, key) for j in group], dim=0)  # noqa: E731
    latents = torch.cat([pad(j.latents) for j in group], dim=0)
    cond = torch.cat([pad(j.tensors.cond) for j in group], dim=0)
    timestep = torch.stack([t.to(runner.device) for t in timesteps]).to(latents.dtype)
    guidance = cat("guidance") if group[0].tensors.guidance is not None else None
    forward = lambda: transformer(  # noqa: E731
        hidden_states=torch.cat((latents, cond), dim=2),
        timestep=timestep / 1000,
        guidance=guidance,
        pooled_projections=cat("pooled"),
        encoder_hidden_states=cat("prompt_embeds"),
        txt_ids=group[0].tensors.txt_ids,
        img_ids=longest.tensors.img_ids,
        joint_attention_kwargs=None,
        return_dict=False,
    )[0]
    if any(j.tensors.controls for j in group):  # one resolution, uncached rows (the runner's plain calls)
        noise_pred = _with_controls(runner, group, latents, cond, timestep, guidance, cat("pooled"),
                                    cat("prompt_embeds"), ctx)
    else:
        if packed:
            ctx = _packed_context(transformer, group, ctx)
        noise_pred = FluxCacheHooks.of(transformer).run(ctx, forward) if ctx is not None else forward()
    for i, (job, t, n) in enumerate(zip(group, timesteps, tokens)):
        job.latents = job.scheduler.step(noise_pred[i:i + 1, :n], t, job.latents, return_dict=False)[0]
        job.step_index += 1


def _with_controls(runner, group: list, latents, cond, timestep, guidance, pooled, text, ctx=None) -> torch.Tensor:
    """Our extension: ControlNet residuals (``maskedit.controlnets.flux``; the ControlNets see the noisy latents
    only) added to the Fill transformer's blocks through its ``controlnet_block_samples`` /
    ``controlnet_single_block_samples``, as FLUX.1-dev takes them in ``FluxControlNetInpaintPipeline``. Placed in the
    ``controlnet`` model (``controlnets.flux_remote``), the calls overlap the transformer's start."""
    transformer = runner.transformer
    jt = group[0].tensors
    ts = timestep / 1000
    splits, lists = flux_remote.step_lists(runner, group, lambda j: j.tensors.controls, latents, ts, guidance, pooled,
                                           text, jt.txt_ids, jt.img_ids)
    pred = torch.empty_like(latents)
    for idx in splits:
        sel = torch.tensor(idx, device=latents.device)
        double, single = lists(idx)
        forward = lambda: transformer(  # noqa: E731
            hidden_states=torch.cat((latents[sel], cond[sel]), dim=2), timestep=ts[sel],
            guidance=guidance[sel] if guidance is not None else None, pooled_projections=pooled[sel],
            encoder_hidden_states=text[sel], controlnet_block_samples=double, controlnet_single_block_samples=single,
            txt_ids=jt.txt_ids, img_ids=jt.img_ids, joint_attention_kwargs=None, return_dict=False)[0]
        if ctx is not None and ctx.temporal is not None:  # temporal reuse of these rows (plain rows otherwise)
            sub = StepContext([None] * len(idx), temporal=ctx.temporal.subset(idx))
            pred[sel] = FluxCacheHooks.of(transformer).run(sub, forward)
        else:
            pred[sel] = forward()
    return pred


def _packed_context(transformer, group: list, ctx: StepContext | None) -> StepContext:
    """Every row through the gathered path, with its own token count and rotary tables."""
    n_blocks = len(FluxCacheHooks.of(transformer).blocks)
    rows = ctx.rows if ctx is not None else [None] * len(group)
    views = []
    for job, view in zip(group, rows):
        view = view if view is not None else RowView(modes=[FULL] * n_blocks)
        view.tokens = job.latents.shape[1]
        jt = job.tensors
        if jt.rope is None:  # the request's own grid: the same tables a call at its size builds
            jt.rope = transformer.pos_embed(torch.cat((jt.txt_ids, jt.img_ids), dim=0))
        view.rope = jt.rope
        views.append(view)
    return StepContext(views, packed=True, on_block=ctx.on_block if ctx is not None else None,
                       temporal=ctx.temporal if ctx is not None else None)
