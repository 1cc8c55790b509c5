"""SD 2 and SDXL inpainting (``StableDiffusionInpaintPipeline``, ``StableDiffusionXLInpaintPipeline``): the
9-channel inpainting UNet with classifier-free guidance, one token per latent pixel. The two share every part of
the UNet path (the step, the per-level mask-aware hooks); what differs (SDXL's second text encoder, its pooled and
time-id conditioning, its VAE upcast) is read from the components, so they are one family with two pipelines."""

from __future__ import annotations

from pathlib import Path

from ..base import Geometry, ModelFamily
from . import tiny


class UNetInpaint(ModelFamily):
    name = "unet_inpaint"
    pipeline_classes = ("StableDiffusionInpaintPipeline", "StableDiffusionXLInpaintPipeline")
    denoiser = "unet"
    negative_prompt = True
    presets = tiny.UNET_PRESETS
    tiny_preset = "sdxl-tiny"
    adapters_in_masked_path = True  # cache.py adds the adapter deltas (``maskedit.adapters.delta``)
    # Requests with ControlNets are cached: the ControlNets' blocks behind the same hooks
    # (``maskedit.cache.controlnet``), their residuals (full-token convolutions) added by the UNet's own forward.
    controls_in_masked_path = True
    temporal_reuse = True  # DeepCache-style: the deep features reused (``temporal.py``)

    @property
    def text_components(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2") if "XL" in self.pipeline_class_name else ("text_encoder",)

    def pipeline_kwargs(self) -> dict:
        if "XL" in self.pipeline_class_name:
            return {}
        return {"safety_checker": None, "requires_safety_checker": False}  # edits are composited into the template

    def served_options(self) -> frozenset[str]:
        return frozenset({"guidance_rescale"}) if "XL" in self.pipeline_class_name else frozenset()

    def lora_loader_kwargs(self, denoiser) -> dict:
        return {"unet_config": denoiser.config}  # as load_lora_weights passes it: kohya's SGM block numbers

    def load_denoiser(self, settings):
        from diffusers import UNet2DConditionModel

        from ...device import torch_dtype
        from ...presets import generated

        gen = generated(settings.model_dir, self.denoiser)
        if gen is not None:
            return tiny.generate_unet(settings.model_dir, gen["seed"], settings.torch_device, torch_dtype(settings))
        model = UNet2DConditionModel.from_pretrained(settings.model_dir, subfolder="unet", dtype=torch_dtype(settings))
        return model.to(settings.torch_device).eval()

    def geometry(self, settings) -> Geometry:
        from diffusers import AutoencoderKL, UNet2DConditionModel

        scale = 2 ** (len(AutoencoderKL.load_config(settings.model_dir, subfolder="vae")["block_out_channels"]) - 1)
        levels = len(UNet2DConditionModel.load_config(settings.model_dir, subfolder="unet")["block_out_channels"])
        # One token per latent pixel; sides divisible through every UNet downsampling.
        return Geometry(vae_scale=scale, patch=scale, multiple=scale * 2 ** (levels - 1))

    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        return len(pipe.tokenizer(prompt).input_ids)  # CLIP's 77

    def prepare(self, pipe, scheduler_config, image, mask, token_mask, w, h, params, settings):
        from .prepare import prepare_unet

        return prepare_unet(pipe, scheduler_config, image, mask, token_mask, w, h, params, settings.torch_device)

    def check_scheduler(self, scheduler_config: dict) -> None:
        from .prepare import check_unet_scheduler

        check_unet_scheduler(scheduler_config)

    def prepare_job(self, runner, job) -> None:
        from .step import prepare_job

        prepare_job(runner, job)

    def group_key(self, job):
        # A UNet's convolutions cannot pack different sizes into one batch: one resolution per call.
        return tuple(job.tensors.prompt_embeds.shape), job.inputs.model_h, job.inputs.model_w

    def step(self, runner, group, ctx) -> None:
        from .step import step_group

        step_group(runner, group, ctx)

    def cache_hooks(self, denoiser):
        from .cache import UNetCacheHooks

        return UNetCacheHooks.of(denoiser)

    def temporal_hooks(self, denoiser):
        from .temporal import UNetTemporalHooks

        return UNetTemporalHooks.of(denoiser)

    # ControlNets (``controlnet.py``): the ControlNet inpaint pipelines' per-step residuals.
    controlnet_classes = ("ControlNetModel", "ControlNetUnionModel")
    union_controlnet_classes = ("ControlNetUnionModel",)

    def check_controlnet(self, controlnet, denoiser) -> None:
        from .controlnet import check_controlnet

        check_controlnet(controlnet, denoiser)

    def prepare_control_image(self, pipe, image, w, h, settings, crop=None):
        from .controlnet import prepare_control_image

        return prepare_control_image(pipe, image, w, h, settings.torch_device, crop)

    def control_residuals(self, control, inputs, scale):
        from .controlnet import control_residuals

        return control_residuals(control, inputs, scale)

    def build_controlnets(self, out, seed=0):
        from .controlnet import build_controlnets

        return build_controlnets(self.model_dir, out, seed)

    def setup_decoder(self, vae) -> None:
        from .prepare import setup_decoder

        setup_decoder(vae)

    def decode(self, pipe, latents, w, h):
        from .prepare import decode

        return decode(pipe, latents, w, h)

    @classmethod
    def build(cls, out_dir: str | Path, preset: str, seed: int = 0) -> Path:
        return tiny.build_unet(out_dir, preset, seed)
