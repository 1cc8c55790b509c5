"""FLUX.1 Kontext inpainting (``diffusers.FluxKontextInpaintPipeline``) as the model family ``flux_kontext``: an
instruction-following in-context edit model (FLUX.1's transformer over packed latents, guidance embedded) that sees
a *reference* image's tokens after the noisy ones and inpaints by blending latents, like FLUX.2 [klein].

Files: ``tiny.py`` (presets ``kontext-tiny`` 256 px, ``kontext-bench`` 512 px with Flux ``bench``'s 4 + 8 blocks,
``kontext-dev`` FLUX.1-Kontext-dev's transformer with weights generated on the device), ``prepare.py`` (request
tensors, the reference image), ``step.py`` (a request's tensors on the device, the step), ``cache.py`` (the
mask-aware hooks: FLUX.1's, with reference rows).

A request is a template, a mask and an instruction prompt, and optionally one reference image (``REFERENCE_IMAGES``,
the stock pipeline's ``image_reference``, brought to the model size); without one the template is the reference, as
in the stock pipeline. The reference tokens' rows are cached like the unmasked tokens' (docs/caching.md "Reference
rows"), and the key names the reference image, so a hit computes the text and the masked noisy tokens only. The
stock pipeline's ``strength``, ``padding_mask_crop`` (the reference image cropped as the template) and
``true_cfg_scale`` with a negative prompt (``families.true_cfg``) are served as its. LoRA
adapters go through the shared adapter path (FLUX.1's hooks add their deltas on the masked path), and temporal reuse
(``TEMPORAL``) through FLUX.1's hooks too (a residual covers the image stream, or a hit's masked tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from ..base import Geometry, ModelFamily, Prepared
from ..true_cfg import with_negative
from . import tiny


class FluxKontextFamily(ModelFamily):
    name: ClassVar[str] = "flux_kontext"
    # A FLUX.1-Kontext-dev checkout (``FluxKontextPipeline``) is served as it is: its components load into the
    # inpainting pipeline.
    pipeline_classes: ClassVar[tuple[str, ...]] = ("FluxKontextInpaintPipeline", "FluxKontextPipeline")
    denoiser: ClassVar[str] = "transformer"
    text_components: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    presets: ClassVar[dict] = tiny.PRESETS
    tiny_preset: ClassVar[str] = "kontext-tiny"
    adapters_in_masked_path: ClassVar[bool] = True  # FLUX.1's hooks add the adapter deltas
    blends_unmasked: ClassVar[bool] = True  # the pipeline re-noises the template outside the mask every step
    temporal_reuse: ClassVar[bool] = True  # FLUX.1's hooks skip a reusing row's middle blocks (``maskedit.temporal``)
    max_reference_images: ClassVar[int] = 1  # ``image_reference``: one image

    def __init__(self, model_dir, pipeline_class: str = "FluxKontextInpaintPipeline"):
        super().__init__(model_dir, pipeline_class)

    def pipeline_class(self):
        from diffusers import FluxKontextInpaintPipeline

        return FluxKontextInpaintPipeline

    # -- components ---------------------------------------------------------------------------------------
    def load_denoiser(self, settings):
        from diffusers import FluxTransformer2DModel

        from ...device import torch_dtype
        from ...presets import generated

        gen = generated(self.model_dir, self.denoiser)
        if gen is not None:  # a preset whose weights are generated on the device
            return tiny.generate_transformer(self.model_dir, gen["seed"], settings.torch_device,
                                             torch_dtype(settings))
        model = FluxTransformer2DModel.from_pretrained(self.model_dir, subfolder="transformer",
                                                       dtype=torch_dtype(settings))
        return model.to(settings.torch_device).eval()

    def geometry(self, settings=None) -> Geometry:
        from diffusers import AutoencoderKL

        cfg = AutoencoderKL.load_config(self.model_dir, subfolder="vae")
        scale = 2 ** (len(cfg["block_out_channels"]) - 1)
        return Geometry(vae_scale=scale, patch=2 * scale, multiple=2 * scale)  # 2x2 latents packed

    # -- pre-processing -----------------------------------------------------------------------------------
    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        return len(pipe.tokenizer_2(prompt).input_ids)  # T5: the encoder with the length limit

    def prepare(self, pipe, scheduler_config, image, mask, token_mask, w, h, params, settings) -> Prepared:
        from .prepare import prepare_tensors

        t = prepare_tensors(pipe, scheduler_config, image, mask, np.asarray(token_mask, bool), w, h, params.prompt,
                            params.seed, params.template_seed, params.steps, settings.max_sequence_length,
                            settings.torch_device, strength=getattr(params, "strength", 1.0))
        text, pooled = with_negative(pipe, params, t["prompt_embeds"][0], t["pooled"][0], settings)
        return Prepared(latents=t["latents"][0], cond=t["cond"][0], prompt_embeds=text, pooled_embeds=pooled)

    def prepare_references(self, pipe, images: list, w: int, h: int, settings, crop=None):
        """The stock pipeline crops its ``image_reference`` with the template's ``padding_mask_crop`` box."""
        from .prepare import reference_latents

        rows, grid = reference_latents(pipe, images[0], w, h, settings.torch_device, crop)
        return rows, (grid,)

    # -- the stock pipeline's options ------------------------------------------------------------------------
    def served_options(self) -> frozenset[str]:
        return frozenset({"true_cfg_scale"})  # FluxKontextInpaintPipeline's (true_cfg.py)

    def uses_negative_prompt(self, params) -> bool:
        return getattr(params, "true_cfg_scale", 1.0) > 1

    # -- denoising ------------------------------------------------------------------------------------------
    def check_scheduler(self, scheduler_config: dict) -> None:
        name = scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if name != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"FLUX.1 Kontext inpainting runs FlowMatchEulerDiscreteScheduler, not {name}")

    def prepare_job(self, runner, job) -> None:
        from .step import prepare_job

        if not hasattr(self, "_patch"):
            self._patch = self.geometry().patch
        prepare_job(runner, job, self._patch)

    def group_key(self, job):
        """One call per resolution, reference layout and text length: the reference tokens extend the sequence,
        and the packed (mixed-resolution) path is not implemented for this family."""
        return (tuple(job.tensors.prompt_embeds.shape), job.inputs.model_h, job.inputs.model_w,
                tuple(job.tensors.img_ids.shape))

    def temporal_negative_call(self, job) -> bool:
        """Temporal reuse (``maskedit.temporal.admit``): TRUE_CFG_SCALE > 1 makes a second call per step, with the
        negative prompt, that reuses on its own stream (``true_cfg.apply``)."""
        return job.tensors.negative is not None

    def step(self, runner, group: list, ctx) -> None:
        from .step import step

        step(runner, group, ctx)

    def cache_hooks(self, denoiser):
        from .cache import KontextCacheHooks

        return KontextCacheHooks.of(denoiser)

    def lora_loader_kwargs(self, denoiser) -> dict:
        return {"return_alphas": True}  # FluxLoraLoaderMixin returns the alphas only when asked

    # -- decoding -------------------------------------------------------------------------------------------
    def decode(self, pipe, latents, w: int, h: int):
        from ..latent_blend import decode_flux1

        return decode_flux1(pipe, latents, w, h)

    # -- presets --------------------------------------------------------------------------------------------
    @classmethod
    def dir_name(cls, preset: str) -> str:
        return preset

    @classmethod
    def build(cls, out_dir: str | Path, preset: str, seed: int = 0) -> Path:
        return tiny.build(out_dir, preset, seed)


__all__ = ["FluxKontextFamily"]
