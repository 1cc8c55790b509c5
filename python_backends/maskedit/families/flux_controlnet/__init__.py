"""Flux ControlNet inpainting (``diffusers.FluxControlNetInpaintPipeline``) as the model family ``flux_controlnet``:
a FLUX.1-dev transformer (the packed latents only: 64 input channels at FLUX.1 size, guidance embedded) that
inpaints by blending latents, with ``FluxControlNetModel`` ControlNets (several summed as
``FluxMultiControlNetModel`` sums them) named per request from the ControlNet library.

Files: ``tiny.py`` (presets ``flux-cn-tiny`` / ``flux-cn-bench`` and their ControlNet libraries), ``prepare.py``
(request tensors, control images), ``step.py`` (a request's tensors on the device, the step),
and ``maskedit.controlnets.flux`` (ControlNet residuals batched across requests, merged per request, shared with
Flux Fill's ControlNet extension).

How it differs from Flux Fill: Fill's transformer sees the mask and the masked image as extra input channels
(384 = 64 latents + 64 masked-image latents + 256 mask); this transformer sees the noisy latents only, and after
every scheduler step the pipeline puts the template back outside the mask,
``latents = (1 - m) * scale_noise(image_latents, t_next, noise) + m * latents`` (``m``: the mask at the latent grid).
Each ControlNet takes the noisy latents plus its control image's packed VAE latents and returns one residual per
(some) transformer block, added after the block (``controlnet_block_samples`` / ``controlnet_single_block_samples``,
spread over the blocks by ``ceil(blocks / samples)``), scaled by the control's conditioning scale while the step is
within its [start, end] fraction of the schedule.

Caching: requests are cached as Flux Fill's are (the same transformer class, so the same block hooks,
``maskedit.cache.flux``); the blend makes its unmasked tokens follow the template's trajectory exactly, as for
FLUX.2 [klein]. With controls the key covers them (``cache.key.control_identity``) and each ControlNet's blocks sit
behind the same hooks, recorded in the template run and computing only masked rows on a hit
(``maskedit.cache.controlnet``); the residuals are added per token between the blocks by the transformer's forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from ..base import Geometry, ModelFamily, Prepared
from ..flux_controls import FluxControls
from ..true_cfg import with_negative
from . import tiny

class FluxControlNetFamily(FluxControls, ModelFamily):
    name: ClassVar[str] = "flux_controlnet"
    # A FLUX.1-dev checkout (``FluxPipeline``) is served as it is: its components load into the ControlNet
    # inpainting pipeline.
    pipeline_classes: ClassVar[tuple[str, ...]] = ("FluxControlNetInpaintPipeline", "FluxPipeline")
    denoiser: ClassVar[str] = "transformer"
    text_components: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    presets: ClassVar[dict] = tiny.PRESETS
    tiny_preset: ClassVar[str] = "flux-cn-tiny"
    controls_in_masked_path: ClassVar[bool] = True  # maskedit.cache.controlnet
    blends_unmasked: ClassVar[bool] = True  # the pipeline re-noises the template outside the mask every step
    temporal_reuse: ClassVar[bool] = True  # the Flux block hooks skip a reusing row's middle blocks

    def pipeline_class(self):
        from diffusers import FluxControlNetInpaintPipeline

        return FluxControlNetInpaintPipeline

    def pipeline_kwargs(self) -> dict:
        return {"controlnet": None}  # ControlNets are the request's, from the library

    # -- the stock pipelines' options ------------------------------------------------------------------------
    def served_options(self) -> frozenset[str]:
        return frozenset({"true_cfg_scale"})  # FluxInpaintPipeline's (requests without controls)

    def uses_negative_prompt(self, params) -> bool:
        return getattr(params, "true_cfg_scale", 1.0) > 1 and not params.controls

    def check_options(self, params) -> None:
        super().check_options(params)
        if getattr(params, "true_cfg_scale", 1.0) > 1 and params.controls:
            from ...errors import InvalidInput

            raise InvalidInput("is a parameter of FluxInpaintPipeline, not of FluxControlNetInpaintPipeline: leave "
                               "it at 1 with CONTROLS", "TRUE_CFG_SCALE")

    # -- components ---------------------------------------------------------------------------------------
    def load_denoiser(self, settings):
        from diffusers import FluxTransformer2DModel

        from ...device import torch_dtype
        from ...presets import generated

        gen = generated(self.model_dir, self.denoiser)
        if gen is not None:
            return tiny.generate_transformer(self.model_dir, gen["seed"], settings.torch_device,
                                             torch_dtype(settings))
        model = FluxTransformer2DModel.from_pretrained(self.model_dir, subfolder="transformer",
                                                       dtype=torch_dtype(settings))
        return model.to(settings.torch_device).eval()

    def geometry(self, settings=None) -> Geometry:
        from diffusers import AutoencoderKL

        cfg = AutoencoderKL.load_config(self.model_dir, subfolder="vae")
        scale = 2 ** (len(cfg["block_out_channels"]) - 1)
        return Geometry(vae_scale=scale, patch=2 * scale, multiple=2 * scale)

    # -- ControlNets ----------------------------------------------------------------------------------------
    def check_controlnet(self, controlnet, denoiser) -> None:
        from ...controlnets.flux import check_fits

        check_fits(controlnet, denoiser, denoiser.config.in_channels)

    def prepare_control_image(self, pipe, image, w: int, h: int, settings, crop=None):
        """Its packed VAE posterior (N, 2C) (``prepare.control_posterior``; the sample is drawn with the edit's
        generator, in the pipeline's order). ``crop`` is not used: ``FluxControlNetInpaintPipeline`` crops the
        template and the mask with ``padding_mask_crop`` but passes its control images to ``prepare_image`` whole,
        resized to the model size as without a crop (diffusers 0.42; tested against it)."""
        from .prepare import control_posterior

        return control_posterior(pipe, image, w, h)

    def control_residuals(self, control, inputs: dict, scale: float) -> list:
        """One ControlNet call for one job's rows: its double then single block samples, scaled."""
        from ...controlnets import flux as R

        use = R.Use(0, 0, inputs["controlnet_cond"], scale, inputs.get("controlnet_mode"))
        double, single = R.per_net(control.model, [use], inputs["hidden_states"], inputs["timestep"],
                                   inputs.get("guidance"), inputs["pooled_projections"],
                                   inputs["encoder_hidden_states"], inputs["txt_ids"], inputs["img_ids"])
        return [*(double or []), *(single or [])]

    # -- pre-processing -----------------------------------------------------------------------------------
    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        return len(pipe.tokenizer_2(prompt).input_ids)  # T5: the encoder with the length limit

    def prepare(self, pipe, scheduler_config, image, mask, token_mask, w, h, params, settings) -> Prepared:
        from .prepare import prepare_tensors

        t = prepare_tensors(pipe, scheduler_config, image, mask, np.asarray(token_mask, bool), w, h, params.prompt,
                            params.seed, params.template_seed, params.steps, settings.max_sequence_length,
                            settings.torch_device, n_controls=len(getattr(params, "controls", ()) or ()),
                            strength=getattr(params, "strength", 1.0))
        text, pooled = with_negative(pipe, params, t["prompt_embeds"][0], t["pooled"][0], settings)
        return Prepared(latents=t["latents"][0], cond=t["cond"][0], prompt_embeds=text, pooled_embeds=pooled)

    # -- denoising ------------------------------------------------------------------------------------------
    def check_scheduler(self, scheduler_config: dict) -> None:
        name = scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if name != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"Flux ControlNet inpainting runs FlowMatchEulerDiscreteScheduler, not {name}")

    def prepare_job(self, runner, job) -> None:
        from diffusers import AutoencoderKL

        from .step import prepare_job

        if not hasattr(self, "_vae_config"):
            self._vae_config = dict(AutoencoderKL.load_config(self.model_dir, subfolder="vae"))
        mode = lambda spec, config: (  # noqa: E731
            self.control_mode_index(spec.mode, config) if config.get("num_mode") is not None else None)
        prepare_job(runner, job, runner.geometry.patch, self._vae_config, mode)

    def group_key(self, job):
        """One call per resolution and text length (text tokens attend: they cannot be padded; the blend and
        the residuals are per token grid)."""
        return tuple(job.tensors.prompt_embeds.shape), job.inputs.model_h, job.inputs.model_w

    def temporal_negative_call(self, job) -> bool:
        """Temporal reuse (``maskedit.temporal.admit``): TRUE_CFG_SCALE > 1 (requests without CONTROLS) makes a
        second call per step, with the negative prompt, that reuses on its own stream (``true_cfg.apply``)."""
        return job.tensors.negative is not None

    def step(self, runner, group: list, ctx) -> None:
        from .step import step

        step(runner, group, ctx)

    def cache_hooks(self, denoiser):
        """The Flux blocks' hooks (``maskedit.cache.flux``): this is Flux Fill's transformer class."""
        from ...cache.flux import FluxCacheHooks

        return FluxCacheHooks.of(denoiser)

    # -- decoding -------------------------------------------------------------------------------------------
    def decode(self, pipe, latents, w: int, h: int):
        from ..latent_blend import decode_flux1

        return decode_flux1(pipe, latents, w, h)

    # -- presets --------------------------------------------------------------------------------------------
    @classmethod
    def dir_name(cls, preset: str) -> str:
        return preset

    def build_controlnets(self, out: Path, seed: int = 0) -> list[Path]:
        """The preset's ControlNets (``tiny.build`` writes them beside the model already; kept if there)."""
        import json

        from ...settings import SERVING_DEFAULTS_FILE

        preset = json.loads((self.model_dir / SERVING_DEFAULTS_FILE).read_text()).get("preset", self.tiny_preset)
        return tiny.build_library(Path(out), tiny.PRESETS[preset], seed)

    @classmethod
    def build(cls, out_dir: str | Path, preset: str, seed: int = 0) -> Path:
        return tiny.build(out_dir, preset, seed)


__all__ = ["FluxControlNetFamily"]
