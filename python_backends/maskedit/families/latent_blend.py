"""What the inpainting pipelines that blend latents share (FLUX.1 Kontext, FLUX.2 [klein], Flux ControlNet,
Qwen-Image-Edit): none of their transformers sees the mask; the pipeline starts from the template's latents noised
at the first timestep and, after every scheduler step, puts the template back outside the mask. Each family's
``prepare`` / ``step`` mirror their stock ``__call__`` and call these pieces at the same points, so the results stay
those of the stock pipelines bit for bit (their parity tests).
"""

from __future__ import annotations

import numpy as np
import torch


def initial_latents(scheduler, t0, image_latents: torch.Tensor, noise: torch.Tensor, pack, token_mask,
                    own: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed (latents, noise, image latents) as ``prepare_latents`` makes them: ``image_latents`` noised with
    ``noise`` at ``t0``. ``own``: the noise a generator seeded with SEED drew (None when SEED is TEMPLATE_SEED): the
    edited tokens (``token_mask``) take it, so a seed varies only the masked noise and a cache entry's template
    context is the same for every seed."""
    latents = scheduler.scale_noise(image_latents, t0, noise)
    noise_p, latents_p, image_p = pack(noise), pack(latents), pack(image_latents)
    if own is not None:
        rows = torch.from_numpy(np.flatnonzero(token_mask)).to(noise_p.device)
        noise_p[:, rows] = pack(own)[:, rows]
        latents_p[:, rows] = pack(scheduler.scale_noise(image_latents, t0, own))[:, rows]
    return latents_p, noise_p, image_p


def step_and_blend(job, pred: torch.Tensor, t, image_latents: torch.Tensor, noise: torch.Tensor,
                   m: torch.Tensor) -> None:
    """``job``'s scheduler step on its prediction ``pred`` at timestep ``t``, then the blend:
    ``latents = (1 - m) * scale_noise(image_latents, t_next, noise) + m * latents`` (after the last step the clean
    template latents); advances its step index."""
    stepped = job.scheduler.step(pred, t, job.latents, return_dict=False)[0]
    proper = image_latents
    ts = job.scheduler.timesteps
    if job.step_index < len(ts) - 1:
        proper = job.scheduler.scale_noise(image_latents, ts[job.step_index + 1].reshape(1), noise)
    job.latents = (1 - m) * proper + m * stepped
    job.step_index += 1


@torch.no_grad()
def decode_flux1(pipe, latents: torch.Tensor, w: int, h: int, output_type: str = "pil"):
    """FLUX.1's packed latents (1, N, C) to an image at model resolution, as its pipelines' post-processing does
    (Kontext and ControlNet inpainting)."""
    vae = pipe.vae
    x = pipe._unpack_latents(latents.to(vae.device, vae.dtype), h, w, pipe.vae_scale_factor)
    x = (x / vae.config.scaling_factor) + vae.config.shift_factor
    image = vae.decode(x, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type=output_type)[0]
