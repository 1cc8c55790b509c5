"""FLUX.2 [klein] inpainting: a request's tensors, one denoise step, decoding — mirroring
``Flux2KleinInpaintPipeline.__call__`` (diffusers 0.42) so results equal it for the same seed (strength 1.0).

What this pipeline does differently from Flux Fill (``maskedit.preprocess``):

- the mask is *not* an input of the transformer. The template's latents are an in-context reference: its packed
  VAE latents (not masked) are appended to the noisy latents along the sequence (``[noisy N; reference N]``, image
  ids with time coordinate 0 and 10), and after every scheduler step the latents are blended back,
  ``latents = (1 - m) * scale_noise(image_latents, t_next, noise) + m * latents`` with ``m`` the mask bilinearly
  resized to the token grid (values in [0, 1]);
- the VAE is encoded with ``sample_mode="argmax"`` (the generator is not consumed) and normalised with the VAE's
  latent batch-norm statistics; the generator draws only the noise;
- the text is Qwen3's hidden states at layers 9, 18, 27 of the chat-templated prompt (padded to
  ``max_sequence_length``), no pooled embedding, no guidance embedding (klein 4B is step-distilled: no
  classifier-free guidance; a base model with guidance > 1 is refused);
- timesteps: sigmas ``linspace(1, 1/steps)`` shifted with ``mu = compute_empirical_mu(tokens, steps)``.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinInpaintPipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein_inpaint import compute_empirical_mu, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from ...schedule import first_step
from ..latent_blend import initial_latents, step_and_blend
from ..per_row import per_row
from .tiny import TEXT_LAYERS

REF_T = 10  # the reference image's time coordinate (``_prepare_image_ids``' scale)


def make_scheduler(config: dict, steps: int, image_seq_len: int, device="cpu",
                   first: int = 0) -> FlowMatchEulerDiscreteScheduler:
    """One request's scheduler, set as ``__call__`` step 5 sets it (``get_timesteps``: from the strength's first
    step, 0 at 1.0)."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps)
    retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(first)
    return scheduler


def latent_ids(grid_h: int, grid_w: int, device, reference_grids=()) -> torch.Tensor:
    """(2N + R, 4) position ids of ``[noisy; template reference; reference images]`` tokens, as ``__call__``
    combines them (``reference_grids``: the further reference images' token grids, all one size as the pipeline
    resizes them to its first)."""
    dummy = torch.zeros(1, 1, grid_h, grid_w)
    noisy = Flux2KleinInpaintPipeline._prepare_latent_ids(dummy)
    refs = [dummy] + ([torch.zeros(len(reference_grids), 1, *reference_grids[0])] if reference_grids else [])
    ref = Flux2KleinInpaintPipeline._prepare_image_ids(refs, 1, scale=REF_T)
    return torch.cat([noisy, ref], dim=1)[0].to(device)


@torch.no_grad()
def reference_latents(pipe, images: list, w: int, h: int, device) -> tuple[torch.Tensor, tuple]:
    """Reference images (PIL) as ``__call__`` takes ``image_reference`` at the model size: pre-processed together
    (``resize_mode="crop"``), encoded as ``prepare_image_latents`` encodes them (the VAE's mode: no draw) and
    packed one after another: (k * N, C) rows and each image's token grid."""
    x = pipe.image_processor.preprocess(images, h, w, resize_mode="crop")
    dtype = pipe.text_encoder.dtype
    lat = pipe._encode_vae_image(image=x.to(device=pipe.vae.device, dtype=dtype), generator=None).to(device)
    packed = pipe._pack_latents(lat)  # (k, N, C)
    return packed.reshape(-1, packed.shape[-1]), ((lat.shape[2], lat.shape[3]),) * len(images)


def text_ids(length: int, device) -> torch.Tensor:
    return Flux2KleinInpaintPipeline._prepare_text_ids(torch.zeros(1, length, 1))[0].to(device)


@torch.no_grad()
def prepare_tensors(pipe, scheduler_config: dict, image: torch.Tensor, mask: torch.Tensor, token_mask: np.ndarray,
                    w: int, h: int, prompt: str, seed: int, template_seed: int, steps: int,
                    max_sequence_length: int, device, strength: float = 1.0) -> dict:
    """``latents`` (1, N, C), ``cond`` (1, N, 2C+1) = [reference latents | noise | blend mask], ``prompt_embeds``
    (1, L, D). One generator seeded with ``template_seed`` is consumed as the pipeline consumes its generator
    (the noise only); tokens of ``token_mask`` then take noise drawn from ``seed``."""
    generator = torch.Generator("cpu").manual_seed(template_seed)
    prompt_embeds, _ = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1,
                                          max_sequence_length=max_sequence_length,
                                          text_encoder_out_layers=TEXT_LAYERS)
    dtype = prompt_embeds.dtype
    patch = pipe.vae_scale_factor * 2
    gh, gw = h // patch, w // patch
    first = first_step(type(pipe), steps, strength)  # get_timesteps: STRENGTH runs the schedule's last steps
    scheduler = make_scheduler(scheduler_config, steps, gh * gw, device, first=first)
    t0 = scheduler.timesteps[first:first + 1].repeat(1)
    c = pipe.latent_channels * 4  # patchified channels (the transformer's in_channels)
    # prepare_latents: encode (argmax: no draw), draw the noise, noise the image latents at the first timestep.
    image_latents = pipe._encode_vae_image(image=image.to(device=pipe.vae.device, dtype=dtype), generator=generator)
    image_latents = image_latents.to(device)
    draw = lambda g: randn_tensor((1, c, gh, gw), generator=g, device=torch.device(device), dtype=dtype)  # noqa
    noise = draw(generator)
    own = draw(torch.Generator("cpu").manual_seed(seed)) if seed != template_seed and token_mask.any() else None
    latents_p, noise_p, image_p = initial_latents(scheduler, t0, image_latents, noise, pipe._pack_latents,
                                                  token_mask, own)
    # The reference tokens (prepare_image_latents of the encoded image: the same packed latents) and the blend mask
    # (prepare_mask_latents: bilinear to the token grid, packed).
    m = pipe.prepare_mask_latents(mask, 1, 1, h, w, dtype, device)
    return {"latents": latents_p, "cond": torch.cat([image_p, noise_p, m], dim=-1), "prompt_embeds": prompt_embeds}


def split_cond(cond: torch.Tensor, c: int):
    """(reference / image latents, noise, blend mask) views of ``cond`` (..., 2C+1)."""
    return cond[..., :c], cond[..., c:2 * c], cond[..., 2 * c:2 * c + 1]


def _references(job, c: int) -> torch.Tensor:
    """A job's reference tokens: the template's latents, then its reference images' (1, N + R, C)."""
    template = split_cond(job.tensors.cond, c)[0]
    extra = job.tensors.reference
    return template if extra is None else torch.cat([template, extra], dim=1)


def rowwise_modulation(transformer) -> None:
    """Klein's per-request layers one batch row at a time (``families.per_row``; plain batch-1 calls unchanged)."""
    per_row(transformer, (transformer.time_guidance_embed, transformer.double_stream_modulation_img,
                          transformer.double_stream_modulation_txt, transformer.single_stream_modulation,
                          transformer.norm_out))


def step_group(runner, group: list, ctx=None, hooks_of=None) -> None:
    """One transformer call for ``group`` (same resolution and text length), then each job's scheduler step and
    the pipeline's blend back to the template outside the mask."""
    tr = runner.transformer
    if len(group) > 1:
        rowwise_modulation(tr)
    n, c = group[0].latents.shape[1], group[0].latents.shape[2]
    timesteps = [j.scheduler.timesteps[j.step_index] for j in group]
    latents = torch.cat([j.latents for j in group], dim=0)
    ref = torch.cat([_references(j, c) for j in group], dim=0)
    timestep = torch.stack([t.to(latents.device) for t in timesteps]).to(latents.dtype)
    hidden = torch.cat([latents, ref], dim=1).to(tr.dtype)
    text = torch.cat([j.tensors.prompt_embeds for j in group], dim=0)
    jt = group[0].tensors
    forward = lambda: tr(hidden_states=hidden, timestep=timestep / 1000, guidance=None,  # noqa: E731
                         encoder_hidden_states=text, txt_ids=jt.txt_ids, img_ids=jt.img_ids,
                         joint_attention_kwargs=None, return_dict=False)[0]
    pred = hooks_of(tr).run(ctx, forward) if ctx is not None else forward()
    pred = pred[:, :n]
    for i, (job, t) in enumerate(zip(group, timesteps)):
        step_and_blend(job, pred[i:i + 1], t, *split_cond(job.tensors.cond, c))


@torch.no_grad()
def vae_latents(pipe, latents: torch.Tensor, w: int, h: int) -> torch.Tensor:
    """Packed rows (1, N, C) to the VAE's latents (1, c, h/8, w/8), as ``__call__`` step 8 (``output_type="latent"``
    returns these)."""
    patch = pipe.vae_scale_factor * 2
    ids = Flux2KleinInpaintPipeline._prepare_latent_ids(torch.zeros(1, 1, h // patch, w // patch)).to(latents.device)
    x = pipe._unpack_latents_with_ids(latents, ids)
    vae = pipe.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x.device, x.dtype)
    return pipe._unpatchify_latents(x * std + mean)


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, w: int, h: int, output_type: str = "pil"):
    x = vae_latents(pipe, latents.to(pipe.vae.device, pipe.vae.dtype), w, h)
    image = pipe.vae.decode(x, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type=output_type)[0]
