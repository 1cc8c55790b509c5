"""Stage 3: final latents to the response image (VAE decode, back to the template's size, composite, PNG)."""

from __future__ import annotations

import base64

import numpy as np
import torch
from PIL import Image

from . import imaging
from .components import family, load_pipeline
from .settings import Settings


class Decoder:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.pipe = load_pipeline(settings, with_transformer=False, with_text=False)
        self.vae = self.pipe.vae
        self.family = family(settings)
        self.family.setup_decoder(self.vae)

    @torch.no_grad()
    def decode_latents(self, latents: np.ndarray, model_w: int, model_h: int) -> Image.Image:
        """Latent rows (tokens, C) to a PIL image at model resolution, as the family's stock pipeline decodes."""
        x = torch.from_numpy(np.ascontiguousarray(latents)).unsqueeze(0).to(self.settings.torch_device, self.vae.dtype)
        return self.family.decode(self.pipe, x, model_w, model_h)

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
