"""Stage 1 for SD 2 / SDXL inpainting: an edit's tensors for the 9-channel inpainting UNet.

Mirrors ``StableDiffusionInpaintPipeline.__call__`` / ``StableDiffusionXLInpaintPipeline.__call__`` (at
``strength=1.0`` the masked region is generated from noise; below it from the template noised to the schedule's
first step run) and calls the pipeline's own methods
(``encode_prompt``, ``mask_processor``, ``prepare_mask_latents``) with one generator consumed in the same order
(noise, then the masked image's VAE sample), so the served result equals stock Diffusers for the same seed.

The tensors travel in the same four slots as Flux's, one row per latent pixel (row-major):
- ``latents`` (N, 4): the initial noise, scaled by the scheduler's ``init_noise_sigma`` (strength < 1: the
  template's latents with the noise added at the first timestep run);
- ``cond`` (N, 5): the latent-size mask and the masked image's latents (what the UNet's extra input channels get);
- ``prompt_embeds`` (R*77, D): with classifier-free guidance (guidance > 1, R = 2) the negative prompt's rows, then
  the prompt's, as the pipeline concatenates them; R = 1 without;
- ``pooled_embeds``: SDXL: per guidance row its pooled text embedding then its time ids (R*(P+T),); SD 2: one 0.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from ...schedule import first_step
from ..base import Prepared

UNET_LATENT_CHANNELS = 4


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """(1, C, h, w) -> (h*w, C): one row per latent pixel."""
    return x[0].permute(1, 2, 0).reshape(-1, x.shape[1])


def from_rows(rows: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, C) -> (B, C, h, w), contiguous: a channels-last view would make torch.cat and the convolutions take
    other kernels than the pipeline's (results off in the last bits)."""
    return rows.unflatten(1, (h, w)).permute(0, 3, 1, 2).contiguous()


def cfg_rows(guidance: float) -> int:
    """UNet rows per request: 2 with classifier-free guidance (the pipelines' ``guidance_scale > 1``), else 1."""
    return 2 if guidance > 1 else 1


_STOCHASTIC = ("EulerAncestralDiscreteScheduler", "KDPM2AncestralDiscreteScheduler", "DPMSolverSDEScheduler")


def check_unet_scheduler(config: dict) -> None:
    """Refuse at start-up a scheduler this server cannot run deterministically per request: samplers that add fresh
    noise at every step (ancestral, SDE) would need the pipeline's generator state in the denoise process, and
    multi-timestep-per-step schedulers (PNDM) break the one-step-per-iteration batching."""
    name = config.get("_class_name", "")
    if name in _STOCHASTIC or "sde" in str(config.get("algorithm_type", "")):
        raise ValueError(f"scheduler {name} adds noise at every step; serve a deterministic one (Euler, DDIM, "
                         "DPM-Solver++, ...): edit the model directory's scheduler/scheduler_config.json")
    make_unet_scheduler(config, 4)


def make_unet_scheduler(config: dict, steps: int, device="cpu", first: int = 0):
    """The request's own scheduler (its class from the model directory), set as the pipelines set it
    (``retrieve_timesteps`` then ``get_timesteps``: begin index at the strength's first step, 0 at 1.0)."""
    import diffusers

    cls = getattr(diffusers, config["_class_name"])
    scheduler = cls.from_config(config)
    scheduler.set_timesteps(steps, device=device)
    if len(scheduler.timesteps) != steps:
        raise ValueError(f"scheduler {config['_class_name']} runs {len(scheduler.timesteps)} timesteps for {steps} "
                         "steps; serve a one-timestep-per-step scheduler (Euler, DDIM, DPM-Solver, ...)")
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(first)
    return scheduler


def time_ids(pipe, h: int, w: int) -> tuple[list[float], list[float]]:
    """SDXL's added time ids (positive, negative) for an uncropped h x w request, as ``_get_add_time_ids`` builds
    them with the pipeline's defaults (it reads the UNet, which this process does not load)."""
    size, crop = (h, w), (0, 0)
    if pipe.config.requires_aesthetics_score:
        return list(size + crop + (6.0,)), list(size + crop + (2.5,))
    return list(size + crop + size), list(size + crop + size)


@torch.no_grad()
def prepare_unet(pipe, scheduler_config: dict, init_image: torch.Tensor, mask_t: torch.Tensor, token_mask: np.ndarray,
                 w: int, h: int, params, device) -> Prepared:
    """The four tensors of one edit. ``init_image`` (1, 3, h, w) from the image processor, ``mask_t`` (1, 1, h, w)
    from the mask processor, ``token_mask`` (N,) the latent pixels the edit touches."""
    xl = hasattr(pipe, "text_encoder_2")
    cfg = params.guidance > 1
    if xl:
        pos, neg, pooled, neg_pooled = pipe.encode_prompt(
            prompt=params.prompt, prompt_2=None, device=device, num_images_per_prompt=1,
            do_classifier_free_guidance=cfg, negative_prompt=params.negative_prompt or None)
    else:
        pos, neg = pipe.encode_prompt(params.prompt, device, 1, cfg, params.negative_prompt or None)
    dtype = pos.dtype
    strength = getattr(params, "strength", 1.0)
    first = first_step(type(pipe), params.steps, strength)  # get_timesteps: STRENGTH runs the last steps
    scheduler = make_unet_scheduler(scheduler_config, params.steps, device, first=first)
    generator = torch.Generator("cpu").manual_seed(params.template_seed)
    shape = (1, UNET_LATENT_CHANNELS, h // pipe.vae_scale_factor, w // pipe.vae_scale_factor)
    # prepare_latents: at strength 1 noise (the generator's first draw) scaled by the scheduler's initial sigma;
    # below it the image's VAE sample draws first, then the noise, added at the first timestep run.
    image_latents = None
    if strength != 1.0:
        image_latents = pipe._encode_vae_image(image=init_image.to(device=device, dtype=dtype), generator=generator)
    t0 = scheduler.timesteps[first:first + 1]

    def start(noise):
        return noise * scheduler.init_noise_sigma if image_latents is None else \
            scheduler.add_noise(image_latents, noise, t0)

    latents = randn_tensor(shape, generator=generator, device=torch.device(device), dtype=dtype)
    latent_rows = to_rows(start(latents))
    if params.seed != params.template_seed:  # the edit's own noise on the tokens it changes
        own = start(randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(params.seed),
                                 device=torch.device(device), dtype=dtype))
        rows = torch.from_numpy(token_mask).to(latents.device)
        latent_rows[rows] = to_rows(own)[rows]
    masked_image = init_image * (mask_t < 0.5)
    mask, masked_latents = pipe.prepare_mask_latents(mask_t, masked_image, 1, h, w, dtype, device, generator, False)
    if xl:
        ids, neg_ids = (torch.tensor(t, dtype=dtype, device=pooled.device) for t in time_ids(pipe, h, w))
        rows = [(neg_pooled[0], neg_ids)] if cfg else []
        pooled_rows = torch.cat([t for r in rows + [(pooled[0], ids)] for t in r])
    else:
        pooled_rows = torch.zeros(1, dtype=dtype)
    return Prepared(latents=latent_rows, cond=to_rows(torch.cat([mask, masked_latents], dim=1)),
                    prompt_embeds=torch.cat([neg[0], pos[0]]) if cfg else pos[0], pooled_embeds=pooled_rows)


def setup_decoder(vae) -> None:
    """SDXL's VAE overflows in fp16; its pipeline upcasts it for decoding too."""
    if vae.dtype == torch.float16 and getattr(vae.config, "force_upcast", False):
        vae.to(torch.float32)


@torch.no_grad()
def decode(pipe, rows: torch.Tensor, w: int, h: int):
    """Latent rows (1, h*w, 4) decoded as the SD 2 / SDXL pipelines decode."""
    vae = pipe.vae
    x = from_rows(rows, h // pipe.vae_scale_factor, w // pipe.vae_scale_factor).to(vae.dtype)
    cfg = vae.config
    mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
    if mean is not None and std is not None:
        x = x * torch.tensor(std).view(1, -1, 1, 1).to(x) / cfg.scaling_factor + torch.tensor(mean).view(
            1, -1, 1, 1).to(x)
    else:
        x = x / cfg.scaling_factor
    image = vae.decode(x, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pil")[0]
