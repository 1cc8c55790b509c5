"""A FLUX.1 Kontext inpainting edit's tensors, mirroring ``FluxKontextInpaintPipeline.__call__`` (diffusers 0.42)
with the pipeline's own methods and one generator consumed in its order, so the served result equals stock Diffusers
for the same components, inputs and seed (tested, with ``strength``, ``padding_mask_crop`` and ``true_cfg_scale``).

What the pipeline does: the transformer (FLUX.1's, the packed latents only, guidance embedded) sees the noisy
latents followed by *reference* tokens along the sequence — the reference image's packed VAE latents (``image_reference``)
or, without one, the template's own — with position ids ``(1, row, col)`` against the noisy tokens' ``(0, row,
col)``; the prompt is an instruction. After every scheduler step it blends the template back outside the mask,
``latents = (1 - m) * scale_noise(image_latents, t_next, noise) + m * latents`` (``m``: the mask at the latent grid,
nearest, repeated over the channels; after the last step the clean latents). The VAE is encoded with its mode
(``sample_mode="argmax"``), so the generator draws the noise first; the masked image's VAE sample drawn after it is
never read (left out here: nothing after it draws).

Slots (packed token order, C = 4 x VAE latent channels = the transformer's ``in_channels``): ``latents`` (N, C) the
initial noisy latents; ``cond`` (N, 3C) ``[image latents | noise | blend mask]``; ``prompt_embeds`` (T5 tokens, D);
``pooled_embeds`` (CLIP pooled,); ``reference`` (R, C) the reference image's packed latents (None: the template's,
which ``cond`` holds) with its token grid in ``reference_grids``.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxKontextInpaintPipeline
from diffusers.utils.torch_utils import randn_tensor

from ...schedule import first_step, make_scheduler
from ..latent_blend import initial_latents

REF_T = 1  # the reference tokens' first position id (``prepare_latents``: ``image_ids[..., 0] = 1``)


def split_cond(cond: torch.Tensor, c: int):
    """(image latents, noise, blend mask) views of ``cond`` (..., 3C)."""
    return cond[..., :c], cond[..., c:2 * c], cond[..., 2 * c:3 * c]


@torch.no_grad()
def reference_latents(pipe, image, w: int, h: int, device, crop=None) -> tuple[torch.Tensor, tuple[int, int]]:
    """A reference image (PIL) as ``__call__`` takes ``image_reference`` at the model size without auto-resizing
    (step 2.1: the image processor's resize, then its pre-processing, which crops it as the template with
    ``padding_mask_crop``: ``crop`` (x1, y1, x2, y2) at the model size, resized back to it "fill"), encoded as
    ``prepare_latents`` encodes it (the VAE's mode: no draw) and packed: (R, C) rows and the token grid (rows, cols)."""
    fit = {"crops_coords": tuple(crop), "resize_mode": "fill"} if crop is not None else {}
    image = pipe.image_processor.preprocess(pipe.image_processor.resize(image, h, w), h, w, **fit)
    image = image.to(dtype=torch.float32)
    dtype = pipe.text_encoder_2.dtype if pipe.text_encoder_2 is not None else pipe.vae.dtype
    ref = pipe._encode_vae_image(image=image.to(device=device, dtype=dtype), generator=None)
    packed = FluxKontextInpaintPipeline._pack_latents(ref, 1, pipe.latent_channels, ref.shape[2], ref.shape[3])
    return packed[0], (ref.shape[2] // 2, ref.shape[3] // 2)


@torch.no_grad()
def prepare_tensors(pipe, scheduler_config: dict, image: torch.Tensor, mask: torch.Tensor, tokens: np.ndarray,
                    w: int, h: int, prompt: str, seed: int, template_seed: int, steps: int, max_sequence_length: int,
                    device, strength: float = 1.0) -> dict:
    """``image`` (1, 3, h, w) from the pipeline's image processor, ``mask`` (1, 1, h, w) in {0, 1} from its mask
    processor, ``tokens`` (N,) bool: the tokens the edit touches. A reference image is encoded apart
    (``reference_latents``: the VAE's mode draws nothing, so the generator's order is the same)."""
    generator = torch.Generator("cpu").manual_seed(template_seed)
    prompt_embeds, pooled, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device,
                                                  num_images_per_prompt=1, max_sequence_length=max_sequence_length)
    dtype = prompt_embeds.dtype
    lc = pipe.latent_channels
    lh, lw = 2 * (h // (pipe.vae_scale_factor * 2)), 2 * (w // (pipe.vae_scale_factor * 2))
    pack = lambda x: FluxKontextInpaintPipeline._pack_latents(x, 1, lc, x.shape[2], x.shape[3])  # noqa: E731
    draw = lambda g: randn_tensor((1, lc, lh, lw), generator=g, device=torch.device(device), dtype=dtype)  # noqa
    # Step 4 (get_timesteps: STRENGTH runs the schedule's last steps), step 5 prepare_latents: the template encoded
    # with the VAE's mode (no draw), then the noise, noised to the first timestep run.
    first = first_step(type(pipe), steps, strength)
    scheduler = make_scheduler(scheduler_config, steps, len(tokens), device, first=first)
    t0 = scheduler.timesteps[first:first + 1]
    image_latents = pipe._encode_vae_image(image=image.to(device=device, dtype=dtype), generator=generator)
    noise = draw(generator)
    own = draw(torch.Generator("cpu").manual_seed(seed)) if seed != template_seed and tokens.any() else None
    latents_p, noise_p, image_p = initial_latents(scheduler, t0, image_latents, noise, pack, tokens, own)
    # prepare_mask_latents' mask (nearest to the latent grid, repeated over the channels, packed).
    m = torch.nn.functional.interpolate(mask, size=(lh, lw)).to(device=device, dtype=dtype)
    m = pack(m.repeat(1, lc, 1, 1))
    return {"latents": latents_p, "cond": torch.cat([image_p, noise_p, m], dim=-1), "prompt_embeds": prompt_embeds,
            "pooled": pooled}


def image_ids(grid_h: int, grid_w: int, ref_grid: tuple[int, int], device, dtype) -> torch.Tensor:
    """(N + R, 3) position ids of ``[noisy; reference]`` tokens, as ``__call__`` combines them."""
    noisy = FluxKontextInpaintPipeline._prepare_latent_image_ids(1, grid_h, grid_w, device, dtype)
    ref = FluxKontextInpaintPipeline._prepare_latent_image_ids(1, ref_grid[0], ref_grid[1], device, dtype)
    ref[..., 0] = REF_T
    return torch.cat([noisy, ref], dim=0)
