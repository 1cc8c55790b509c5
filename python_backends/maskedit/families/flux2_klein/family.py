"""The ``flux2_klein`` family class: FLUX.2 [klein] inpainting behind ``maskedit.families.base.ModelFamily``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..base import Geometry, ModelFamily, Prepared
from . import prepare as P
from . import tiny


@dataclass
class KleinTensors:
    """A request's conditioning on the device (the fields of ``denoise.JobTensors``, klein's meaning)."""

    cond: torch.Tensor  # (1, N, 2C+1): reference latents | noise | blend mask
    prompt_embeds: torch.Tensor  # (1, L, D)
    pooled: torch.Tensor | None  # unused (klein has no pooled text)
    img_ids: torch.Tensor  # (2N + R, 4): noisy tokens (T=0), the template's (T=10), reference images' (T=20, ...)
    txt_ids: torch.Tensor  # (L, 4)
    guidance: torch.Tensor | None = None  # unused (no guidance embedding)
    rope: tuple | None = None
    reference: torch.Tensor | None = None  # (1, R, C): reference images' tokens after the template's


class Flux2KleinFamily(ModelFamily):
    name: ClassVar[str] = "flux2_klein"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("Flux2KleinInpaintPipeline",)
    denoiser: ClassVar[str] = "transformer"
    text_components: ClassVar[tuple[str, ...]] = ("text_encoder",)
    negative_prompt: ClassVar[bool] = False
    presets: ClassVar[dict[str, Any]] = tiny.PRESETS
    tiny_preset: ClassVar[str] = "klein-tiny"
    adapters_in_masked_path: ClassVar[bool] = True  # cache.py adds the adapter deltas
    blends_unmasked: ClassVar[bool] = True  # the pipeline re-noises the template outside the mask every step
    temporal_reuse: ClassVar[bool] = True  # cache.py's hooks skip a reusing row's middle blocks
    max_reference_images: ClassVar[int] = 4  # ``image_reference`` takes a list (the deployment may cap it lower)

    def __init__(self, model_dir, pipeline_class: str = "Flux2KleinInpaintPipeline"):
        super().__init__(model_dir, pipeline_class)

    # -- components ---------------------------------------------------------------------------------------
    def load_denoiser(self, settings):
        from ...device import torch_dtype
        from ...presets import generated

        dtype = torch_dtype(settings)
        gen = generated(self.model_dir, self.denoiser)
        if gen is not None:  # a preset whose weights are generated on the device
            return tiny.generate_transformer(self.model_dir, gen["seed"], settings.torch_device, dtype)
        from diffusers import Flux2Transformer2DModel

        model = Flux2Transformer2DModel.from_pretrained(self.model_dir, subfolder="transformer", dtype=dtype)
        return model.to(settings.torch_device).eval()

    def geometry(self, settings=None) -> Geometry:
        from diffusers import AutoencoderKLFlux2

        cfg = AutoencoderKLFlux2.load_config(self.model_dir, subfolder="vae")
        scale = 2 ** (len(cfg["block_out_channels"]) - 1)
        return Geometry(vae_scale=scale, patch=2 * scale, multiple=2 * scale)

    # -- pre-processing -----------------------------------------------------------------------------------
    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        """Tokens of the chat-templated prompt (what is padded or truncated to ``max_sequence_length``)."""
        text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=False)
        return len(pipe.tokenizer(text).input_ids)

    def prepare(self, pipe, scheduler_config: dict, image, mask, token_mask, w: int, h: int, params,
                settings) -> Prepared:
        if params.guidance > 1 and not pipe.config.is_distilled:
            from ...errors import InvalidInput

            raise InvalidInput("above 1 needs classifier-free guidance, which this family does not serve yet "
                               "(klein base models); use 1.0 or a distilled klein model", "GUIDANCE")
        t = P.prepare_tensors(pipe, scheduler_config, image, mask, np.asarray(token_mask, bool), w, h,
                              params.prompt, params.seed, params.template_seed, params.steps,
                              settings.max_sequence_length, settings.torch_device,
                              strength=getattr(params, "strength", 1.0))
        return Prepared(latents=t["latents"][0], cond=t["cond"][0], prompt_embeds=t["prompt_embeds"][0],
                        pooled_embeds=torch.zeros(1, dtype=t["latents"].dtype))

    def prepare_references(self, pipe, images: list, w: int, h: int, settings, crop=None):
        return P.reference_latents(pipe, images, w, h, settings.torch_device)  # the stock pipeline never crops them

    # -- denoising ------------------------------------------------------------------------------------------
    def check_scheduler(self, scheduler_config: dict) -> None:
        name = scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if name != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"FLUX.2 klein inpainting runs FlowMatchEulerDiscreteScheduler, not {name}")

    def prepare_job(self, runner, job) -> None:
        x = job.inputs
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(runner.device, runner.dtype)  # noqa: E731
        job.latents = t(x.latents).unsqueeze(0)
        n = job.latents.shape[1]
        patch = int(round((x.model_h * x.model_w / n) ** 0.5))
        text = t(x.prompt_embeds).unsqueeze(0)
        extra = getattr(x, "reference", None)
        grids = tuple(getattr(x, "reference_grids", ())) if extra is not None else ()
        job.tensors = KleinTensors(cond=t(x.cond).unsqueeze(0), prompt_embeds=text, pooled=None,
                                   img_ids=P.latent_ids(x.model_h // patch, x.model_w // patch, runner.device, grids),
                                   txt_ids=P.text_ids(text.shape[1], runner.device),
                                   reference=None if extra is None else t(extra).unsqueeze(0))
        job.scheduler = P.make_scheduler(runner.scheduler_config, x.steps, n, runner.device)

    def group_key(self, job):
        """One call per resolution, reference layout and text length: the reference tokens extend the sequence, and
        the packed (mixed-resolution) path of ``maskedit.families.flux_fill.cache`` is not implemented for this
        family."""
        return (tuple(job.tensors.prompt_embeds.shape), job.inputs.model_h, job.inputs.model_w,
                tuple(job.tensors.img_ids.shape))

    def step(self, runner, group: list, ctx) -> None:
        hooks_of = None
        if ctx is not None:
            from .cache import Flux2KleinCacheHooks

            hooks_of = Flux2KleinCacheHooks.of
        P.step_group(runner, group, ctx, hooks_of=hooks_of)

    def cache_hooks(self, denoiser):
        from .cache import Flux2KleinCacheHooks

        return Flux2KleinCacheHooks.of(denoiser)

    # -- decoding -------------------------------------------------------------------------------------------
    def decode(self, pipe, latents, w: int, h: int):
        return P.decode(pipe, latents, w, h)

    # -- presets --------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, out_dir: str | Path, preset: str, seed: int = 0) -> Path:
        return tiny.build(out_dir, preset, seed)
