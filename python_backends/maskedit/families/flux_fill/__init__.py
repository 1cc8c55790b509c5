"""Flux Fill inpainting (``FluxFillPipeline``, e.g. FLUX.1-Fill-dev): a dual/single-stream transformer over packed
2x2 latent patches with the masked image and mask as extra input channels and guidance embedded (no negative
row)."""

from __future__ import annotations

from pathlib import Path

from ..base import Geometry, ModelFamily
from ..flux_controls import FluxControls
from . import tiny


class FluxFill(FluxControls, ModelFamily):
    name = "flux_fill"
    pipeline_classes = ("FluxFillPipeline",)
    denoiser = "transformer"
    text_components = ("text_encoder", "text_encoder_2")
    presets = tiny.PRESETS
    adapters_in_masked_path = True  # cache.py adds the adapter deltas (``maskedit.adapters.delta``)
    temporal_reuse = True  # the Flux block hooks skip a reusing row's middle blocks (``maskedit.temporal``)
    # ControlNets (``FluxControls``) are our extension: docs/controlnet_flux.md, "Flux Fill"

    def load_denoiser(self, settings):
        from diffusers import FluxTransformer2DModel

        from ...device import torch_dtype
        from ...presets import generated

        gen = generated(settings.model_dir, self.denoiser)
        if gen is not None:  # a preset whose weights are generated on the device
            return tiny.generate_transformer(settings.model_dir, gen["seed"], settings.torch_device,
                                             torch_dtype(settings))
        model = FluxTransformer2DModel.from_pretrained(settings.model_dir, subfolder="transformer",
                                                       dtype=torch_dtype(settings))
        return model.to(settings.torch_device).eval()

    def geometry(self, settings) -> Geometry:
        from diffusers import AutoencoderKL

        cfg = AutoencoderKL.load_config(settings.model_dir, subfolder="vae")
        scale = 2 ** (len(cfg["block_out_channels"]) - 1)
        return Geometry(vae_scale=scale, patch=2 * scale, multiple=2 * scale)  # Flux packs 2x2 latents

    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        return len(pipe.tokenizer_2(prompt).input_ids)  # T5: the encoder with the length limit

    def prepare(self, pipe, scheduler_config, image, mask, token_mask, w, h, params, settings):
        from .prepare import prepare

        return prepare(pipe, scheduler_config, image, mask, token_mask, w, h, params, settings,
                       self.geometry(settings).patch)

    # -- ControlNets: our extension (no stock Fill + ControlNet pipeline); the residuals of Flux ControlNets
    # (``maskedit.controlnets.flux``) go to the Fill transformer's blocks, which take them as FLUX.1-dev's do.
    def check_controlnet(self, controlnet, denoiser) -> None:
        from ...controlnets.flux import check_fits

        check_fits(controlnet, denoiser, denoiser.config.out_channels)  # it sees the noisy latents only

    def prepare_control_image(self, pipe, image, w, h, settings, crop=None):
        """The control image's packed VAE latents (N, C): resized by the image processor, the posterior's mean
        (no draw: the edit's generator order, so its noise, is that of the plain Fill edit), shifted and scaled.
        ``crop`` (our extension, no stock pipeline): cropped with the template's box and resized "fill" as the
        template is, as the UNet ControlNet pipelines crop theirs (so the control stays aligned with the crop)."""
        from .prepare import control_latents

        return control_latents(pipe, image, w, h, crop)

    def build_controlnets(self, out: Path, seed: int = 0) -> list[Path]:
        """The tiny ControlNet library (``controlnets.flux_build``: canny, depth, union) fitted to this model's
        transformer: a ControlNet here sees the noisy latents only, so it takes the transformer's output width."""
        from diffusers import FluxTransformer2DModel

        from ...controlnets import flux_build

        cfg = FluxTransformer2DModel.load_config(self.model_dir, subfolder="transformer")
        return flux_build.write_library(Path(out), cfg, cfg["out_channels"], flux_build.TINY_NETS, seed)

    def prepare_job(self, runner, job) -> None:
        from .step import prepare_job

        prepare_job(runner, job, runner.geometry.patch)

    def group_key(self, job):
        return tuple(job.tensors.prompt_embeds.shape)  # text tokens attend: they cannot be padded

    def step(self, runner, group, ctx) -> None:
        from .step import step

        step(runner, group, ctx)

    def cache_hooks(self, denoiser):
        from .cache import FluxCacheHooks

        return FluxCacheHooks.of(denoiser)

    def lora_loader_kwargs(self, denoiser) -> dict:
        return {"return_alphas": True}  # FluxLoraLoaderMixin returns the alphas only when asked

    def decode(self, pipe, latents, w, h):
        from .prepare import decode

        return decode(pipe, latents, w, h)

    @classmethod
    def dir_name(cls, preset: str) -> str:
        return f"{preset}-flux-fill"

    @classmethod
    def build(cls, out_dir: str | Path, preset: str, seed: int = 0) -> Path:
        return tiny.build(out_dir, preset, seed)
