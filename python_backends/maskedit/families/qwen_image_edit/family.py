"""The ``qwen_image_edit`` family class: Qwen-Image-Edit inpainting behind ``maskedit.families.base.ModelFamily``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..base import Geometry, ModelFamily, Prepared
from . import prepare as P
from . import tiny


class QwenImageEditFamily(ModelFamily):
    name: ClassVar[str] = "qwen_image_edit"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImageEditInpaintPipeline",)
    denoiser: ClassVar[str] = "transformer"
    text_components: ClassVar[tuple[str, ...]] = ("text_encoder",)
    negative_prompt: ClassVar[bool] = True  # true classifier-free guidance (``true_cfg_scale`` = GUIDANCE)
    blends_unmasked: ClassVar[bool] = True  # the pipeline re-noises the template outside the mask every step
    presets: ClassVar[dict[str, Any]] = tiny.PRESETS
    tiny_preset: ClassVar[str] = "qwen-edit-tiny"
    adapters_in_masked_path: ClassVar[bool] = True  # cache.py's layers run under the adapters' row owners
    # cache.py's hooks skip a reusing row's middle blocks (``maskedit.temporal``) on the prompt's call and, with its
    # own state (``temporal_negative_call``), on the negative prompt's call of true classifier-free guidance
    temporal_reuse: ClassVar[bool] = True

    def __init__(self, model_dir, pipeline_class: str = "QwenImageEditInpaintPipeline"):
        super().__init__(model_dir, pipeline_class)
        self._geometry: Geometry | None = None
        self._prompts = None  # prompt_cache.EncodedPrompts, made on first use (pre-processing only)

    # -- components ---------------------------------------------------------------------------------------
    def pipeline_kwargs(self) -> dict:
        """Where torchvision does not import, the processor without its video half (``processor``)."""
        from .processor import load_processor, torchvision_imports

        return {} if torchvision_imports() else {"processor": load_processor(self.model_dir / tiny.PROCESSOR)}

    def load_denoiser(self, settings):
        from ...device import torch_dtype
        from ...presets import generated

        dtype = torch_dtype(settings)
        gen = generated(self.model_dir, self.denoiser)
        if gen is not None:  # a preset whose weights are generated on the device
            return tiny.generate_transformer(self.model_dir, gen["seed"], settings.torch_device, dtype)
        from diffusers import QwenImageTransformer2DModel

        model = QwenImageTransformer2DModel.from_pretrained(self.model_dir, subfolder="transformer", dtype=dtype)
        return model.to(settings.torch_device).eval()

    def geometry(self, settings=None) -> Geometry:
        if self._geometry is None:
            from diffusers import AutoencoderKLQwenImage

            cfg = AutoencoderKLQwenImage.load_config(self.model_dir, subfolder="vae")
            scale = 2 ** len(cfg["temperal_downsample"])  # the pipeline's vae_scale_factor
            self._geometry = Geometry(vae_scale=scale, patch=2 * scale, multiple=2 * scale)
        return self._geometry

    def model_size(self, width: int, height: int, settings) -> tuple[int, int]:
        """The pipeline's own sizing: ``calculate_dimensions`` of resolution**2 pixels (1024**2 in the stock
        pipeline) at the template's aspect ratio, rounded down to the token size."""
        return P.model_size(width, height, settings.resolution, self.geometry(settings).multiple)

    # -- pre-processing -----------------------------------------------------------------------------------
    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        """The prompt's own tokens (the encoder's sequence adds the template and the image's tokens)."""
        return len(pipe.tokenizer(prompt).input_ids)

    def prompt_cache(self, settings):
        """This process's cache of encoded prompts per (prompt, template) (``prompt_cache.EncodedPrompts``)."""
        if self._prompts is None:
            from .prompt_cache import EncodedPrompts

            self._prompts = EncodedPrompts(settings.prompt_cache_bytes)
        return self._prompts

    def prepare(self, pipe, scheduler_config: dict, image, mask, token_mask, w: int, h: int, params,
                settings) -> Prepared:
        """``prompt_embeds`` holds the prompt's rows, then the negative prompt's where classifier-free guidance is
        on (GUIDANCE > 1 and a NEGATIVE_PROMPT, as ``true_cfg_scale`` and ``negative_prompt`` turn it on);
        ``pooled_embeds`` their two row counts."""
        if params.steps < 2 and scheduler_config.get("shift_terminal"):
            from ...errors import InvalidInput

            raise InvalidInput("must be at least 2: the scheduler stretches its sigmas to shift_terminal, which "
                               "divides by zero for one step (the stock pipeline returns NaN)", "STEPS")
        img = P.prompt_image(pipe, image)
        cache = self.prompt_cache(settings)

        def encode(text: str) -> torch.Tensor:
            return cache.get(text, img, lambda: pipe.encode_prompt(
                prompt=text, image=img, device=settings.torch_device, num_images_per_prompt=1,
                max_sequence_length=settings.max_sequence_length)[0])

        pos = encode(params.prompt)
        neg = encode(params.negative_prompt) if params.guidance > 1 and params.negative_prompt else None
        t = P.prepare_tensors(pipe, scheduler_config, image, mask, np.asarray(token_mask, bool), w, h, params.seed,
                              params.template_seed, params.steps, pos, settings.torch_device,
                              strength=getattr(params, "strength", 1.0))
        rows = pos[0] if neg is None else torch.cat([pos[0], neg[0]])
        counts = torch.tensor([pos.shape[1], 0 if neg is None else neg.shape[1]], dtype=torch.float32)
        return Prepared(latents=t["latents"][0], cond=t["cond"][0], prompt_embeds=rows, pooled_embeds=counts)

    def check_options(self, params) -> None:
        if getattr(params, "true_cfg_scale", 1.0) > 1:  # the stock pipeline's true_cfg_scale is GUIDANCE here
            from ...errors import InvalidInput

            raise InvalidInput("is served as GUIDANCE by QwenImageEditInpaintPipeline models (its true_cfg_scale); "
                               "leave it at 1", "TRUE_CFG_SCALE")
        super().check_options(params)

    # -- denoising ------------------------------------------------------------------------------------------
    def check_scheduler(self, scheduler_config: dict) -> None:
        name = scheduler_config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if name != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"Qwen-Image-Edit inpainting runs FlowMatchEulerDiscreteScheduler, not {name}")

    def prepare_job(self, runner, job) -> None:
        from .step import prepare_job

        prepare_job(runner, job)

    def group_key(self, job):
        """One call per resolution, text length and negative text length: text is not padded (the stock call has
        no padding mask), the reference tokens double the image sequence, and the packed (mixed-resolution) path
        is not implemented for this family."""
        t = job.tensors
        neg = 0 if t.negative_embeds is None else t.negative_embeds.shape[1]
        return t.prompt_embeds.shape[1], neg, job.inputs.model_h, job.inputs.model_w

    def step(self, runner, group: list, ctx) -> None:
        from .step import step_group

        hooks_of = None
        if ctx is not None:
            from .cache import QwenEditCacheHooks

            hooks_of = QwenEditCacheHooks.of
        step_group(runner, group, ctx, hooks_of=hooks_of)

    def temporal_negative_call(self, job) -> bool:
        """Temporal reuse (``maskedit.temporal.admit``): a request with classifier-free guidance makes a second call
        per step, with the negative prompt, that reuses on its own stream (``step_group``)."""
        return job.tensors.negative_embeds is not None

    def runs_cached(self, inputs) -> bool:
        """Not with classifier-free guidance: its negative call would need recorded rows of its own (entries of
        two rows per token); such requests compute every token."""
        pooled = np.asarray(inputs.pooled_embeds)
        return pooled.shape == (2,) and int(pooled[1]) == 0

    def cache_hooks(self, denoiser):
        from .cache import QwenEditCacheHooks

        return QwenEditCacheHooks.of(denoiser)

    # -- decoding -------------------------------------------------------------------------------------------
    def decode(self, pipe, latents, w: int, h: int):
        return P.decode(pipe, latents, w, h)

    # -- presets --------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, out_dir: str | Path, preset: str, seed: int = 0) -> Path:
        return tiny.build(out_dir, preset, seed)
