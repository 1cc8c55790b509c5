"""Stage 1: turn an edit request (encoded template + mask + prompt) into the denoiser's tensors.

For Flux Fill the tensor math mirrors ``FluxFillPipeline.__call__`` step for step (SD 2 / SDXL inpainting:
``unet_prepare``) and calls the pipeline's own
methods (image/mask processors, ``encode_prompt``, ``prepare_mask_latents``) with one generator consumed
in the same order, so the served result equals stock Diffusers for the same seed (tested).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from . import imaging
from .cache.key import cache_key, model_fingerprint
from .components import FLUX, load_pipeline, model_family
from .errors import InvalidInput
from .params import EditParams
from .schedule import make_scheduler
from .settings import Settings

log = logging.getLogger(__name__)


@dataclass
class PreparedEdit:
    """Everything downstream stages need; arrays only, so it crosses process boundaries as tensors."""

    params: EditParams
    model_w: int
    model_h: int
    template_rgb: np.ndarray  # (H, W, 3) uint8 at the template's own size
    alpha: np.ndarray  # (H, W) uint8, feathered compositing mask at the template's size
    token_mask: np.ndarray  # (tokens,) bool, packed token order
    template_hash: str
    was_base64: bool
    cache_key: str = ""
    # Model tensors; empty (0 rows) when the mask is empty and the model is skipped.
    latents: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # (tokens, C) packed
    cond: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # masked-image latents + mask
    prompt_embeds: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # (txt, D)
    pooled_embeds: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.float32))  # (D_pooled,)

    @property
    def mask_ratio(self) -> float:
        return float(self.token_mask.mean()) if self.token_mask.size else 0.0

    @property
    def empty_mask(self) -> bool:
        return not self.token_mask.any()

    @property
    def skip_model(self) -> bool:
        """Nothing to edit and nothing to record: the template comes back as is."""
        return self.empty_mask and not self.params.register


class Preprocessor:
    def __init__(self, settings: Settings, store=None):
        """``store``: the activation store to check and prefetch from (``maskedit.cache.store``), or None."""
        self.settings = settings
        self.pipe = load_pipeline(settings, with_transformer=False)
        self.scheduler_config = dict(self.pipe.scheduler.config)
        self.fingerprint = model_fingerprint(settings.model_dir, settings.model_version)
        self.store = store
        self.family = model_family(settings.model_dir)
        self.scale = self.pipe.vae_scale_factor  # 8: pixels per latent
        if self.family == FLUX:
            self.patch = self.multiple = self.scale * 2  # pixels per packed token side
        else:  # one token per latent pixel; sides divisible through every UNet downsampling
            from diffusers import UNet2DConditionModel

            levels = len(UNet2DConditionModel.load_config(settings.model_dir, subfolder="unet")["block_out_channels"])
            self.patch, self.multiple = self.scale, self.scale * 2 ** (levels - 1)

    def count_t5_tokens(self, prompt: str) -> int:
        """Tokens of ``prompt`` in the encoder whose length is limited (Flux: T5; SD 2 / SDXL: CLIP's 77)."""
        tokenizer = self.pipe.tokenizer_2 if self.family == FLUX else self.pipe.tokenizer
        return len(tokenizer(prompt).input_ids)

    @torch.no_grad()
    def __call__(self, template: bytes, mask: bytes, params: EditParams) -> PreparedEdit:
        s = self.settings
        template_raw, was_b64 = imaging.maybe_base64(template)
        mask_raw, _ = imaging.maybe_base64(mask)
        tpl = imaging.decode_image(template_raw, "TEMPLATE", s.max_input_pixels).convert("RGB")
        msk = imaging.decode_image(mask_raw, "MASK", s.max_input_pixels)
        binary = imaging.binary_mask(msk, tpl.size, s.mask_threshold)
        for field, text in (("PROMPT", params.prompt), ("NEGATIVE_PROMPT", params.negative_prompt)):
            n_tokens = self.count_t5_tokens(text) if text else 0
            if n_tokens > s.max_sequence_length:
                raise InvalidInput(
                    f"is {n_tokens} tokens long, above the model's limit of {s.max_sequence_length}", field)
        if params.negative_prompt and self.family == FLUX:
            raise InvalidInput("is not used by Flux Fill models (their guidance is embedded: there is no negative "
                               "row); leave it out", "NEGATIVE_PROMPT")

        w, h = imaging.model_size(*tpl.size, s.resolution, multiple=self.multiple)
        template_rgb = np.asarray(tpl, dtype=np.uint8)
        mask_img = imaging.Image.fromarray(binary)
        mask_t = self.pipe.mask_processor.preprocess(mask_img, height=h, width=w)  # (1,1,h,w) in {0,1}
        tokens = imaging.token_mask(mask_t[0, 0].numpy(), self.patch)
        prepared = PreparedEdit(
            params=params, model_w=w, model_h=h, template_rgb=template_rgb,
            alpha=imaging.soft_mask(binary, s.feather_px), token_mask=tokens,
            template_hash=hashlib.sha256(template_rgb.tobytes()).hexdigest()[:32], was_base64=was_b64,
        )
        if params.use_cache:
            prepared.cache_key = cache_key(self.fingerprint, prepared.template_hash, w, h, params.steps,
                                           params.guidance, params.template_seed, self.scheduler_config, s.dtype)
        if prepared.skip_model:
            return prepared  # nothing to edit: the template comes back without running the model
        if self.store is not None and prepared.cache_key:
            self.store.prefetch(prepared.cache_key)  # promote from disk while the request queues

        pipe, device = self.pipe, s.torch_device
        if self.family != FLUX:
            from .unet_prepare import prepare_unet

            init_image = pipe.image_processor.preprocess(tpl, height=h, width=w).to(dtype=torch.float32)
            t = prepare_unet(pipe, self.scheduler_config, init_image, mask_t, tokens, w, h, params, device)
            prepared.latents, prepared.cond = _np(t["latents"]), _np(t["cond"])
            prepared.prompt_embeds, prepared.pooled_embeds = _np(t["prompt_embeds"]), _np(t["pooled_embeds"])
            return prepared
        # One generator seeded with TEMPLATE_SEED is consumed exactly as FluxFillPipeline consumes its generator
        # (image sample, noise, masked-image sample); the masked tokens then take noise drawn from SEED.
        generator = torch.Generator("cpu").manual_seed(params.template_seed)
        init_image = pipe.image_processor.preprocess(tpl, height=h, width=w).to(dtype=torch.float32)
        prompt_embeds, pooled, _ = pipe.encode_prompt(
            prompt=params.prompt, prompt_2=None, device=device, num_images_per_prompt=1,
            max_sequence_length=s.max_sequence_length,
        )
        dtype = prompt_embeds.dtype
        # FluxFillPipeline.prepare_latents: encode the image (consumes the generator), draw noise, scale it.
        scheduler = make_scheduler(self.scheduler_config, params.steps, len(tokens), device)
        latent_h, latent_w = 2 * (h // self.patch), 2 * (w // self.patch)
        c = pipe.vae.config.latent_channels
        image = init_image.to(device=device, dtype=dtype)
        image_latents = pipe._encode_vae_image(image=image, generator=generator)
        noise = randn_tensor((1, c, latent_h, latent_w), generator=generator, device=torch.device(device), dtype=dtype)
        latents = scheduler.scale_noise(image_latents, scheduler.timesteps[:1], noise)
        latents = pipe._pack_latents(latents, 1, c, latent_h, latent_w)
        if params.seed != params.template_seed:
            own = randn_tensor((1, c, latent_h, latent_w), generator=torch.Generator("cpu").manual_seed(params.seed),
                               device=torch.device(device), dtype=dtype)
            own = pipe._pack_latents(scheduler.scale_noise(image_latents, scheduler.timesteps[:1], own), 1, c,
                                     latent_h, latent_w)
            rows = torch.from_numpy(tokens).to(latents.device)
            latents[:, rows] = own[:, rows]
        # FluxFillPipeline.__call__ step 6: masked image latents + packed mask as the conditioning channels.
        masked_image = (init_image * (1 - mask_t)).to(device=device, dtype=dtype)
        mask_packed, masked_latents = pipe.prepare_mask_latents(
            mask_t, masked_image, 1, c, 1, h, w, dtype, device, generator)
        cond = torch.cat((masked_latents, mask_packed), dim=-1)

        prepared.latents = _np(latents[0])
        prepared.cond = _np(cond[0])
        prepared.prompt_embeds = _np(prompt_embeds[0])
        prepared.pooled_embeds = _np(pooled[0])
        return prepared


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()
