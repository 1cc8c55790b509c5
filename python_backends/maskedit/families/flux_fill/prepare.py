"""An edit's tensors for Flux Fill, mirroring ``FluxFillPipeline.__call__`` step for step and calling the pipeline's
own methods (``encode_prompt``, ``_encode_vae_image``, ``prepare_mask_latents``) with one generator consumed in the
same order, so the served result equals stock Diffusers for the same seed (tested).

Slots (packed token order, one row per 2x2 latent patch): ``latents`` (N, 4C) the initial noisy latents; ``cond``
(N, 4C + 64) the masked image's latents and the packed mask; ``prompt_embeds`` (T5 tokens, D); ``pooled_embeds``
(CLIP pooled,).
"""

from __future__ import annotations

import torch
from diffusers.utils.torch_utils import randn_tensor

from ...schedule import first_step, make_scheduler
from ..base import Prepared


@torch.no_grad()
def prepare(pipe, scheduler_config: dict, init_image, mask_t, tokens, w: int, h: int, params, settings,
            patch: int) -> Prepared:
    device = settings.torch_device
    # One generator seeded with TEMPLATE_SEED is consumed exactly as FluxFillPipeline consumes its generator
    # (image sample, noise, masked-image sample); the masked tokens then take noise drawn from SEED.
    generator = torch.Generator("cpu").manual_seed(params.template_seed)
    prompt_embeds, pooled, _ = pipe.encode_prompt(
        prompt=params.prompt, prompt_2=None, device=device, num_images_per_prompt=1,
        max_sequence_length=settings.max_sequence_length,
    )
    dtype = prompt_embeds.dtype
    # get_timesteps (STRENGTH: the schedule's last steps), then FluxFillPipeline.prepare_latents: encode the image
    # (consumes the generator), draw noise, noise the image to the first timestep run.
    first = first_step(type(pipe), params.steps, getattr(params, "strength", 1.0))
    scheduler = make_scheduler(scheduler_config, params.steps, len(tokens), device, first=first)
    t0 = scheduler.timesteps[first:first + 1]
    latent_h, latent_w = 2 * (h // patch), 2 * (w // patch)
    c = pipe.vae.config.latent_channels
    image = init_image.to(device=device, dtype=dtype)
    image_latents = pipe._encode_vae_image(image=image, generator=generator)
    noise = randn_tensor((1, c, latent_h, latent_w), generator=generator, device=torch.device(device), dtype=dtype)
    latents = scheduler.scale_noise(image_latents, t0, noise)
    latents = pipe._pack_latents(latents, 1, c, latent_h, latent_w)
    if params.seed != params.template_seed:
        own = randn_tensor((1, c, latent_h, latent_w), generator=torch.Generator("cpu").manual_seed(params.seed),
                           device=torch.device(device), dtype=dtype)
        own = pipe._pack_latents(scheduler.scale_noise(image_latents, t0, own), 1, c, latent_h, latent_w)
        rows = torch.from_numpy(tokens).to(latents.device)
        latents[:, rows] = own[:, rows]
    # FluxFillPipeline.__call__ step 6: masked image latents + packed mask as the conditioning channels.
    masked_image = (init_image * (1 - mask_t)).to(device=device, dtype=dtype)
    mask_packed, masked_latents = pipe.prepare_mask_latents(
        mask_t, masked_image, 1, c, 1, h, w, dtype, device, generator)
    cond = torch.cat((masked_latents, mask_packed), dim=-1)
    return Prepared(latents=latents[0], cond=cond[0], prompt_embeds=prompt_embeds[0], pooled_embeds=pooled[0])


@torch.no_grad()
def control_latents(pipe, image, w: int, h: int, crop=None) -> torch.Tensor:
    """A control image (PIL) to packed latents (N, C) for a Flux ControlNet (our extension): the image processor's
    resize and normalisation (made contiguous, as ``FluxControlNetInpaintPipeline.prepare_image``'s copy does), the
    VAE posterior's mean, shift and scale, packed. ``crop`` (PADDING_MASK_CROP's box in the template's pixels): the
    image cropped there and resized "fill", as the template is (and as the UNet ControlNet pipelines crop theirs)."""
    vae = pipe.vae
    fit = {"crops_coords": tuple(crop), "resize_mode": "fill"} if crop is not None else {}
    x = pipe.image_processor.preprocess(image, height=h, width=w, **fit).contiguous().to(vae.device, vae.dtype)
    z = (vae.encode(x).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    return pipe._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3])[0]


@torch.no_grad()
def decode(pipe, latents, w: int, h: int):
    """Packed latents (1, tokens, C) to a PIL image at model resolution, as FluxFillPipeline step 8 does."""
    vae = pipe.vae
    x = pipe._unpack_latents(latents, h, w, pipe.vae_scale_factor)
    x = (x / vae.config.scaling_factor) + vae.config.shift_factor
    image = vae.decode(x, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pil")[0]
