"""The FLUX.1 Kontext inpainting denoise step for a group of requests, and a request's tensors on the device.

One step of ``FluxKontextInpaintPipeline``'s loop for every request of the group: one transformer call on
``[noisy; reference]`` tokens, the prediction of the noisy ones, each request's own scheduler step, then the
pipeline's blend back to the template outside the mask. The timestep/guidance embedding and the modulation layers
run per batch row (``families.per_row``), so a batched call equals the stock one-request call bit for bit on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...schedule import make_scheduler
from .. import true_cfg
from ..latent_blend import step_and_blend
from ..per_row import per_row
from .cache import KontextCacheHooks
from .prepare import image_ids, split_cond


@dataclass
class KontextTensors:
    """A request's conditioning on the device, made once when it is admitted."""

    cond: torch.Tensor  # (1, N, 3C): image latents | noise | blend mask
    reference: torch.Tensor  # (1, R, C): the reference tokens (the template's latents without a reference image)
    prompt_embeds: torch.Tensor  # (1, txt, D)
    pooled: torch.Tensor  # (1, D_pooled)
    img_ids: torch.Tensor  # (N + R, 3)
    txt_ids: torch.Tensor  # (txt, 3)
    guidance: torch.Tensor | None  # (1,) when the transformer embeds guidance
    negative: tuple | None = None  # TRUE_CFG_SCALE > 1: its negative text (1, txt, D) and pooled (1, D_pooled)


def prepare_job(runner, job, pixels_per_token: int) -> None:
    x = job.inputs
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(runner.device, runner.dtype).unsqueeze(0)  # noqa
    job.latents = t(x.latents)
    c = job.latents.shape[-1]
    cond = t(x.cond)
    grid = (x.model_h // pixels_per_token, x.model_w // pixels_per_token)
    extra = getattr(x, "reference", None)
    if extra is not None:
        reference, ref_grid = t(extra), tuple(x.reference_grids[0])
    else:
        reference, ref_grid = split_cond(cond, c)[0], grid
    text, pooled, negative = true_cfg.split_negative(x, t(x.prompt_embeds), t(x.pooled_embeds))
    job.tensors = KontextTensors(
        cond=cond, reference=reference, prompt_embeds=text, pooled=pooled, negative=negative,
        img_ids=image_ids(*grid, ref_grid, runner.device, runner.dtype),
        txt_ids=torch.zeros(text.shape[1], 3, device=runner.device, dtype=runner.dtype),
        guidance=(torch.full([1], x.guidance, device=runner.device, dtype=torch.float32)
                  if runner.transformer.config.guidance_embeds else None))
    job.scheduler = make_scheduler(runner.scheduler_config, x.steps, x.latents.shape[0], runner.device)


def per_row_layers(transformer) -> None:
    """FLUX.1's per-request layers: the time/guidance/pooled-text embedding and every block's modulation."""
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    norms = [n.linear for b in blocks for n in (getattr(b, "norm1", None), getattr(b, "norm1_context", None),
                                                 getattr(b, "norm", None)) if n is not None]
    per_row(transformer, [transformer.time_text_embed, *norms, transformer.norm_out.linear])


@torch.no_grad()
def step(runner, group: list, ctx) -> None:
    """One transformer call for ``group`` (one resolution and reference layout, equal text length), then each
    request's scheduler step and blend."""
    tr = runner.transformer
    if len(group) > 1:
        per_row_layers(tr)
    timesteps = [j.scheduler.timesteps[j.step_index] for j in group]
    latents = torch.cat([j.latents for j in group])
    n = latents.shape[1]
    cat = lambda key: torch.cat([getattr(j.tensors, key) for j in group])  # noqa: E731
    hidden = torch.cat([latents, cat("reference")], dim=1)
    timestep = torch.stack([t.to(latents.device) for t in timesteps]).to(latents.dtype)
    jt = group[0].tensors
    guidance = cat("guidance") if jt.guidance is not None else None
    forward = lambda: tr(  # noqa: E731
        hidden_states=hidden, timestep=timestep / 1000, guidance=guidance, pooled_projections=cat("pooled"),
        encoder_hidden_states=cat("prompt_embeds"), txt_ids=jt.txt_ids, img_ids=jt.img_ids,
        joint_attention_kwargs=None, return_dict=False)[0]
    pred = (KontextCacheHooks.of(tr).run(ctx, forward) if ctx is not None else forward())[:, :n]
    true_cfg.apply(tr, group, pred, hidden, timestep / 1000, guidance, jt.txt_ids, jt.img_ids, ctx,
                   KontextCacheHooks.of)  # the negative call reuses on its own stream (``TemporalCall.negative``)
    c = latents.shape[-1]
    for i, (job, t) in enumerate(zip(group, timesteps)):
        step_and_blend(job, pred[i:i + 1], t, *split_cond(job.tensors.cond, c))
