"""Stage 3: final latents to the response image (VAE decode, back to the template's size or into its crop,
composite, encode as PNG / JPEG / WebP)."""

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
               raw: bool, as_base64: bool, crop=None, fmt: str = "png", quality: int = 95) -> bytes:
        """Resize the model output to the template's size and keep the template outside the mask; encode it as
        ``fmt`` (OUTPUT_FORMAT) at ``quality``.

        ``generated=None`` means the mask was empty: the template comes back unchanged. ``crop`` (x1, y1, x2, y2):
        the model edited that crop of the template (PADDING_MASK_CROP); its output goes back there, resized as the
        stock pipelines' ``apply_overlay`` resizes it (the image processor's "crop" mode), the rest is the template.
        """
        h, w = template_rgb.shape[:2]
        if generated is None:
            out = template_rgb
        else:
            if crop is not None:
                x1, y1, x2, y2 = (int(v) for v in crop)
                piece = self.pipe.image_processor.resize(generated, height=y2 - y1, width=x2 - x1, resize_mode="crop")
                pasted = Image.fromarray(template_rgb)
                pasted.paste(piece, (x1, y1))
                generated = pasted
            if generated.size != (w, h):
                generated = generated.resize((w, h), Image.LANCZOS)
            out = np.asarray(generated, dtype=np.uint8)
            if not raw:
                out = imaging.composite(template_rgb, out, alpha)
        data = imaging.encode_image(out, fmt, quality)
        return base64.b64encode(data) if as_base64 else data
