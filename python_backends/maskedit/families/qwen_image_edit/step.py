"""One denoising step of Qwen-Image-Edit inpainting requests: the transformer call(s) of ``ModelRunner`` for this
family, mirroring the loop body of ``QwenImageEditInpaintPipeline.__call__``.

A group (one resolution, one text length, one negative text length) shares one transformer call on
``[noisy; reference]`` tokens with its positive prompts (through the cache's hooks when given), and, when its
requests use classifier-free guidance, a second call with their negative prompts; then per request the guidance
combination, its own scheduler's step and the blend back to the template outside the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...errors import InvalidInput
from ..latent_blend import step_and_blend
from ..per_row import per_row
from ..true_cfg import run_negative
from .prepare import make_scheduler, split_cond


@dataclass
class QwenTensors:
    """A request's conditioning on the device (the fields of ``denoise.JobTensors``, this family's meaning)."""

    cond: torch.Tensor  # (1, N, 3C): reference latents | noise | blend mask
    prompt_embeds: torch.Tensor  # (1, L, D): the prompt's embeddings
    negative_embeds: torch.Tensor | None  # (1, L', D): the negative prompt's, with classifier-free guidance
    img_shapes: list  # the transformer's ``img_shapes`` for one request: noisy tokens, then reference tokens
    pooled: torch.Tensor | None = None  # unused


def text_lengths(pooled: np.ndarray, rows: int) -> tuple[int, int]:
    """(prompt rows, negative rows) of a request's PROMPT_EMBEDS, as ``POOLED_EMBEDS`` carries them."""
    if pooled.shape != (2,) or not np.isfinite(pooled).all() or int(pooled[0]) + int(pooled[1]) != rows \
            or pooled[0] < 1 or pooled[1] < 0:
        raise InvalidInput(f"must hold the prompt's and the negative prompt's row counts of PROMPT_EMBEDS ({rows} "
                           "rows)", "POOLED_EMBEDS")
    return int(pooled[0]), int(pooled[1])


def prepare_job(runner, job) -> None:
    x = job.inputs
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(runner.device, runner.dtype)  # noqa: E731
    n_pos, n_neg = text_lengths(np.asarray(x.pooled_embeds), x.prompt_embeds.shape[0])
    text = t(x.prompt_embeds)
    job.latents = t(x.latents).unsqueeze(0)
    n = job.latents.shape[1]
    patch = runner.geometry.patch
    grid = (1, x.model_h // patch, x.model_w // patch)
    job.tensors = QwenTensors(cond=t(x.cond).unsqueeze(0), prompt_embeds=text[:n_pos].unsqueeze(0),
                              negative_embeds=text[n_pos:].unsqueeze(0) if n_neg else None, img_shapes=[grid, grid])
    job.scheduler = make_scheduler(runner.scheduler_config, x.steps, n, runner.device)


def guided(pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    """The pipeline's true classifier-free guidance, rescaled to the conditional prediction's norm per token."""
    comb = neg + scale * (pos - neg)
    return comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def rowwise_modulation(tr) -> None:
    """The timestep embedding, every block's modulation layers and the output norm, per batch row (``per_row``)."""
    mods = [m for b in tr.transformer_blocks for m in (b.img_mod, b.txt_mod)]
    per_row(tr, [tr.time_text_embed, *mods, tr.norm_out])


@torch.no_grad()
def step_group(runner, group: list, ctx=None, hooks_of=None) -> None:
    tr = runner.transformer
    if len(group) > 1:
        rowwise_modulation(tr)
    n, c = group[0].latents.shape[1], group[0].latents.shape[2]
    timesteps = [j.scheduler.timesteps[j.step_index] for j in group]
    latents = torch.cat([j.latents for j in group], dim=0)
    reference = torch.cat([split_cond(j.tensors.cond, c)[0] for j in group], dim=0)
    timestep = torch.stack([t.to(latents.device) for t in timesteps]).to(latents.dtype)
    hidden = torch.cat([latents, reference], dim=1)  # [noisy N; reference N]: the reference part is the template's
    shapes = [group[0].tensors.img_shapes] * len(group)

    def call(text):
        return tr(hidden_states=hidden, timestep=timestep / 1000, guidance=None, encoder_hidden_states_mask=None,
                  encoder_hidden_states=text, img_shapes=shapes, attention_kwargs={}, return_dict=False)[0][:, :n]

    text = torch.cat([j.tensors.prompt_embeds for j in group], dim=0)
    pred = hooks_of(tr).run(ctx, lambda: call(text)) if ctx is not None else call(text)
    neg = None
    if group[0].tensors.negative_embeds is not None:  # the group shares its guidance (``group_key``)
        # The cache never serves these requests (``ModelFamily.runs_cached``): this call runs every token. Temporal
        # reuse skips blocks on it with the requests' negative stream (``true_cfg.run_negative``: its own residuals
        # and decisions, as the stock pipeline's ``cache_context("uncond")``); without it the hooks see no context.
        negative = torch.cat([j.tensors.negative_embeds for j in group], dim=0)
        neg = run_negative(tr, lambda: call(negative), ctx, hooks_of)
    for i, (job, t) in enumerate(zip(group, timesteps)):
        p = pred[i:i + 1] if neg is None else guided(pred[i:i + 1], neg[i:i + 1], job.inputs.guidance)
        step_and_blend(job, p, t, *split_cond(job.tensors.cond, c))
