"""Qwen-Image-Edit inpainting: a request's tensors and decoding, mirroring ``QwenImageEditInpaintPipeline.__call__``
(diffusers 0.42) so results equal it for the same seed (strength 1.0).

What the pipeline does (and how it differs from the other families):

- it works at ``calculate_dimensions(1024 * 1024, width / height)`` rounded down to the patch (``model_size``);
  its ``height`` / ``width`` arguments are ignored;
- the prompt is encoded by Qwen2.5-VL *together with the template* (resized to the model size): the chat-templated
  prompt holds the image's vision tokens, and the last hidden state of every token after the system prompt is the
  text sequence (its length varies with the prompt and the image: nothing is padded);
- the template is VAE-encoded with a *sampled* latent (the generator's first draw), normalised with the VAE's latent
  mean / std, and its packed latents ride along as N reference tokens after the N noisy ones (the transformer sees
  ``[noisy; reference]`` with rotary frames 0 and 1); the mask is not a model input;
- after every scheduler step the latents are blended back,
  ``latents = (1 - m) * scale_noise(image_latents, t_next, noise) + m * latents``, with ``m`` the binarised mask
  resized (nearest) to the latent grid and packed per channel; after the last step the image latents themselves;
- with ``true_cfg_scale`` > 1 and a negative prompt, a second transformer call on the negative prompt's embeddings
  and a norm-preserving guidance combination.
The masked image's VAE encoding the pipeline also makes is unused by its loop (and comes after every draw of the
generator): it is skipped.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint import (calculate_dimensions, calculate_shift,
                                                                           retrieve_timesteps)
from diffusers.utils.torch_utils import randn_tensor

from ...schedule import first_step
from ..latent_blend import initial_latents

PIPELINE_AREA_SIDE = 1024  # the stock pipeline's area is always 1024 x 1024 pixels


def model_size(width: int, height: int, resolution: int, multiple: int) -> tuple[int, int]:
    """The (w, h) the pipeline works at for a ``width`` x ``height`` image: ``calculate_dimensions`` of the area
    ``resolution**2`` (the stock pipeline's 1024**2) at the image's aspect ratio, rounded down to ``multiple``."""
    w, h, _ = calculate_dimensions(resolution * resolution, width / height)
    return max(multiple, w // multiple * multiple), max(multiple, h // multiple * multiple)


def make_scheduler(config: dict, steps: int, image_seq_len: int, device="cpu",
                   first: int = 0) -> FlowMatchEulerDiscreteScheduler:
    """One request's scheduler, set as ``__call__`` step 4 sets it (``get_timesteps``: from STRENGTH's first step,
    0 at 1.0)."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    cfg = scheduler.config
    mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    retrieve_timesteps(scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    scheduler.set_begin_index(first)
    return scheduler


def prompt_image(pipe, image: torch.Tensor):
    """The template as the PIL image the pipeline hands its VL encoder, from the (1, 3, h, w) tensor its image
    processor made of it (normalising and denormalising 8-bit pixels round-trips exactly: tested)."""
    return pipe.image_processor.postprocess(image.detach().cpu().float(), output_type="pil")[0]


def latent_grid(pipe, w: int, h: int) -> tuple[int, int]:
    """(height, width) of the VAE latents at model size (twice the token grid)."""
    s = pipe.vae_scale_factor * 2
    return 2 * (h // s), 2 * (w // s)


@torch.no_grad()
def prepare_tensors(pipe, scheduler_config: dict, image: torch.Tensor, mask: torch.Tensor, token_mask: np.ndarray,
                    w: int, h: int, seed: int, template_seed: int, steps: int, embeds: torch.Tensor,
                    device, strength: float = 1.0) -> dict:
    """``latents`` (1, N, C), ``cond`` (1, N, 3C) = [reference latents | noise | blend mask]. One generator seeded
    with ``template_seed`` is consumed as ``__call__`` consumes its generator (the VAE's sample, then the noise);
    tokens of ``token_mask`` then take the noise a generator seeded with ``seed`` gives at the same draw."""
    dtype = embeds.dtype
    z = pipe.latent_channels
    lh, lw = latent_grid(pipe, w, h)
    first = first_step(type(pipe), steps, strength)  # get_timesteps: STRENGTH runs the schedule's last steps
    scheduler = make_scheduler(scheduler_config, steps, (lh // 2) * (lw // 2), device, first=first)
    t0 = scheduler.timesteps[first:first + 1].repeat(1)
    generator = torch.Generator("cpu").manual_seed(template_seed)
    # prepare_latents: encode (sampled: the first draw), the noise (the second), noised at the first timestep.
    image_latents = pipe._encode_vae_image(image=image.unsqueeze(2).to(device=device, dtype=dtype),
                                           generator=generator)
    image_latents = torch.cat([image_latents], dim=0).transpose(1, 2)  # [1, 1, z, lh, lw]
    shape = (1, 1, z, lh, lw)
    noise = randn_tensor(shape, generator=generator, device=torch.device(device), dtype=dtype)
    own = None
    if seed != template_seed and token_mask.any():
        own_gen = torch.Generator("cpu").manual_seed(seed)
        vae = pipe.vae
        randn_tensor((1, z, 1, lh, lw), generator=own_gen, device=vae.device, dtype=vae.dtype)  # the VAE's draw
        own = randn_tensor(shape, generator=own_gen, device=torch.device(device), dtype=dtype)
    pack = lambda x: pipe._pack_latents(x, 1, z, lh, lw)  # noqa: E731
    latents_p, noise_p, image_p = initial_latents(scheduler, t0, image_latents, noise, pack, token_mask, own)
    # prepare_mask_latents on latents-shaped input (its "masked image" already latent: not encoded).
    m, _ = pipe.prepare_mask_latents(mask, torch.zeros(1, z, 1, lh, lw), 1, z, 1, h, w, dtype, device, None)
    return {"latents": latents_p, "cond": torch.cat([image_p, noise_p, m], dim=-1)}


def split_cond(cond: torch.Tensor, c: int):
    """(reference / image latents, noise, blend mask) views of ``cond`` (..., 3C)."""
    return cond[..., :c], cond[..., c:2 * c], cond[..., 2 * c:]


@torch.no_grad()
def vae_latents(pipe, latents: torch.Tensor, w: int, h: int) -> torch.Tensor:
    """Packed rows (1, N, C) to the VAE's latents (1, z, 1, h/8, w/8), as ``__call__`` un-normalises them."""
    x = pipe._unpack_latents(latents, h, w, pipe.vae_scale_factor).to(pipe.vae.dtype)
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(x.device, x.dtype)
    std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(x.device, x.dtype)
    return x / std + mean


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, w: int, h: int, output_type: str = "pil"):
    image = pipe.vae.decode(vae_latents(pipe, latents.to(pipe.vae.device), w, h), return_dict=False)[0][:, :, 0]
    return pipe.image_processor.postprocess(image, output_type=output_type)[0]
