"""A Flux ControlNet inpainting edit's tensors, mirroring ``FluxControlNetInpaintPipeline.__call__`` (diffusers
0.42) step for step with the pipeline's own methods and one generator consumed in the same order, so the served
result equals stock Diffusers for the same components, inputs and seed (strength 1.0; tested).

The order the pipeline draws from its generator: each control image's VAE sample (step 5, in control order), the
template's VAE sample and the noise (step 7, ``prepare_latents``), then the masked image's VAE sample (step 8,
``prepare_mask_latents``), whose latents the denoise loop never reads: it is left out here, nothing after it draws.
Control images are prepared apart from the edit (``ModelFamily.prepare_control_image``, without the generator), so
a control travels as its VAE posterior, mean and standard deviation packed (N, 2C); the edit draws each control's
sample noise in the pipeline's order and carries it in ``cond``; admission forms the sample as the VAE does
(``mean + std * eps``, then shift and scale: elementwise, so packing first changes no bit).

Slots (packed token order, one row per 2x2 latent patch; C = 4 x VAE latent channels = the transformer's
``in_channels``): ``latents`` (N, C) the initial noisy latents; ``cond`` (N, 3C + k C) ``[image latents | noise |
blend mask | eps 1 | ... | eps k]``: the template's clean latents and the noise that re-noise the unmasked region
after every step, the pipeline's packed mask (the mask resized to the latent grid, nearest, repeated over the
channels: 0 outside the edit), and the sample noise of each of the request's k control images;
``prompt_embeds`` (T5 tokens, D); ``pooled_embeds`` (CLIP pooled,).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from ...schedule import first_step, make_scheduler
from ..latent_blend import initial_latents


def split_cond(cond: torch.Tensor, c: int):
    """(image latents, noise, blend mask, control sample noise (..., k, C) or None) views of ``cond``."""
    rest = cond[..., 3 * c:]
    eps = rest.unflatten(-1, (rest.shape[-1] // c, c)) if rest.shape[-1] else None
    return cond[..., :c], cond[..., c:2 * c], cond[..., 2 * c:3 * c], eps


@torch.no_grad()
def control_posterior(pipe, image, w: int, h: int) -> torch.Tensor:
    """A control image (PIL) to its packed VAE posterior (N, 2C) ``[mean | std]``: ``prepare_image``'s resize and
    normalisation (the pipeline's image processor), then the VAE encoder (InstantX-style ControlNets: no input hint
    block)."""
    vae = pipe.vae
    # The pipeline's own method: its copy (repeat_interleave) makes the tensor contiguous, and the VAE's
    # convolutions give other bits for the image processor's strided output.
    x = pipe.prepare_image(image=image, width=w, height=h, batch_size=1, num_images_per_prompt=1,
                           device=vae.device, dtype=vae.dtype)
    dist = vae.encode(x).latent_dist
    lc = vae.config.latent_channels
    pack = lambda t: pipe._pack_latents(t, 1, lc, t.shape[2], t.shape[3])[0]  # noqa: E731
    return torch.cat([pack(dist.mean), pack(dist.std)], dim=-1)


def control_latents(vae_config, posterior: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """A control image's packed latents from its posterior (..., 2C) and sample noise (..., C), as step 5 forms them
    (``retrieve_latents``' sample ``mean + std * eps``, then ``(x - shift_factor) * scaling_factor``)."""
    c = eps.shape[-1]
    x = posterior[..., :c] + posterior[..., c:] * eps
    return (x - vae_config["shift_factor"]) * vae_config["scaling_factor"]


@torch.no_grad()
def prepare_tensors(pipe, scheduler_config: dict, image: torch.Tensor, mask: torch.Tensor, tokens: np.ndarray,
                    w: int, h: int, prompt: str, seed: int, template_seed: int, steps: int, max_sequence_length: int,
                    device, n_controls: int = 0, strength: float = 1.0) -> dict:
    """``image`` (1, 3, h, w) from the pipeline's image processor, ``mask`` (1, 1, h, w) in {0, 1} from its mask
    processor, ``tokens`` (N,) bool: the tokens the edit touches; ``n_controls``: the request's control images."""
    generator = torch.Generator("cpu").manual_seed(template_seed)
    prompt_embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device,
                                                  num_images_per_prompt=1, max_sequence_length=max_sequence_length)
    dtype = prompt_embeds.dtype
    lc = pipe.vae.config.latent_channels
    lh, lw = 2 * (h // (pipe.vae_scale_factor * 2)), 2 * (w // (pipe.vae_scale_factor * 2))
    pack = lambda x: pipe._pack_latents(x, 1, lc, lh, lw)  # noqa: E731
    draw = lambda g: randn_tensor((1, lc, lh, lw), generator=g, device=torch.device(device), dtype=dtype)  # noqa
    # Step 5: each control image's VAE sample draws first (the images are resized to the model size).
    eps = [pack(draw(generator)) for _ in range(n_controls)]
    # Step 6 (get_timesteps: STRENGTH runs the schedule's last steps) and step 7, prepare_latents.
    first = first_step(type(pipe), steps, strength)
    scheduler = make_scheduler(scheduler_config, steps, len(tokens), device, first=first)
    t0 = scheduler.timesteps[first:first + 1]
    image_latents = pipe._encode_vae_image(image=image.to(device=device, dtype=dtype), generator=generator)
    noise = draw(generator)
    own = draw(torch.Generator("cpu").manual_seed(seed)) if seed != template_seed and tokens.any() else None
    latents_p, noise_p, image_p = initial_latents(scheduler, t0, image_latents, noise, pack, tokens, own)
    # Step 8, prepare_mask_latents' mask (nearest to the latent grid, repeated over the channels, packed).
    m = torch.nn.functional.interpolate(mask, size=(lh, lw)).to(device=device, dtype=dtype)
    m = pack(m.repeat(1, lc, 1, 1))
    cond = torch.cat([image_p, noise_p, m, *eps], dim=-1)
    return {"latents": latents_p, "cond": cond, "prompt_embeds": prompt_embeds, "pooled": pooled}
