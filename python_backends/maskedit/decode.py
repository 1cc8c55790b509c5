"""Stage 3: final latents to the response image (VAE decode, back to the template's size, composite, PNG)."""

from __future__ import annotations

import base64

import numpy as np
import torch
from PIL import Image

from . import imaging
from .components import FLUX, load_pipeline, model_family
from .settings import Settings


class Decoder:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.pipe = load_pipeline(settings, with_transformer=False, with_text=False)
        self.vae = self.pipe.vae
        self.family = model_family(settings.model_dir)
        if self.family != FLUX and self.vae.dtype == torch.float16 and getattr(self.vae.config, "force_upcast", False):
            self.vae.to(torch.float32)  # SDXL's VAE overflows in fp16; its pipeline upcasts it for decoding too

    @torch.no_grad()
    def decode_latents(self, latents: np.ndarray, model_w: int, model_h: int) -> Image.Image:
        """Packed latents (tokens, C) to a PIL image at model resolution, as FluxFillPipeline step 8 does (SD 2 /
        SDXL: one row per latent pixel, decoded as their pipelines decode)."""
        pipe = self.pipe
        x = torch.from_numpy(np.ascontiguousarray(latents)).unsqueeze(0).to(self.settings.torch_device, self.vae.dtype)
        if self.family != FLUX:
            return self._decode_unet(x, model_w, model_h)
        x = pipe._unpack_latents(x, model_h, model_w, pipe.vae_scale_factor)
        x = (x / self.vae.config.scaling_factor) + self.vae.config.shift_factor
        image = self.vae.decode(x, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")[0]

    def _decode_unet(self, rows: torch.Tensor, model_w: int, model_h: int) -> Image.Image:
        from .unet_prepare import from_rows

        pipe, vae = self.pipe, self.vae
        x = from_rows(rows, model_h // pipe.vae_scale_factor, model_w // pipe.vae_scale_factor)
        cfg = vae.config
        x = x.to(vae.dtype)
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        if mean is not None and std is not None:
            x = x * torch.tensor(std).view(1, -1, 1, 1).to(x) / cfg.scaling_factor + torch.tensor(mean).view(
                1, -1, 1, 1).to(x)
        else:
            x = x / cfg.scaling_factor
        image = vae.decode(x, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")[0]

    def finish(self, generated: Image.Image | None, template_rgb: np.ndarray, alpha: np.ndarray,
               raw: bool, as_base64: bool) -> bytes:
        """Resize the model output to the template's size and keep the template outside the mask.

        ``generated=None`` means the mask was empty: the template comes back unchanged.
        """
        h, w = template_rgb.shape[:2]
        if generated is None:
            out = template_rgb
        else:
            if generated.size != (w, h):
                generated = generated.resize((w, h), Image.LANCZOS)
            out = np.asarray(generated, dtype=np.uint8)
            if not raw:
                out = imaging.composite(template_rgb, out, alpha)
        png = imaging.encode_png(out)
        return base64.b64encode(png) if as_base64 else png
