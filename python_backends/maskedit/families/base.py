"""The model-family protocol: everything the engine, scheduler, cache runtime, pre-processing and decoding need
to know about a model, behind one interface (as vLLM registers model classes and Diffusers keeps model code apart
from pipelines). A family is one subpackage of ``maskedit.families`` holding all of its code — components,
request preparation, the denoise step, the mask-aware block hooks, decoding, tiny and bench presets — and one line
in the registry (``maskedit.families.REGISTRY``). Nothing outside the registry branches on a family's name.

The four tensors a prepared edit carries between processes are the same for every family, in the family's own
layout (documented by each): ``latents`` (tokens, C) the initial noisy latents, one row per image token;
``cond`` (tokens, C') the mask conditioning; ``prompt_embeds`` (rows, D) the text; ``pooled_embeds`` (P,) any
pooled or extra conditioning (zeros when unused). The engine addresses tokens as rows of ``latents``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class Geometry:
    """How pixels map to the tokens the denoiser sees."""

    vae_scale: int  # pixels per latent pixel (8)
    patch: int  # pixels per token side (Flux: 16, two latent pixels packed; a UNet: 8)
    multiple: int  # model sides must be multiples of this (a UNet: through every downsampling)


@dataclass(frozen=True)
class Prepared:
    """One edit's tensors for the denoiser (torch, on the pre-processing device)."""

    latents: Any
    cond: Any
    prompt_embeds: Any
    pooled_embeds: Any


class ModelFamily(ABC):
    """One model family. Instances are per model directory (``REGISTRY.family(model_dir)``)."""

    name: ClassVar[str]  # the registry's name, also ``make demo FAMILY=<name>``
    pipeline_classes: ClassVar[tuple[str, ...]]  # ``model_index.json`` ``_class_name`` values this family serves
    denoiser: ClassVar[str] = "transformer"  # the denoiser's component / subfolder name
    text_components: ClassVar[tuple[str, ...]] = ("text_encoder",)  # left out of processes that do not encode
    negative_prompt: ClassVar[bool] = False  # does the family use a negative prompt (classifier-free guidance)?

    def __init__(self, model_dir: str | Path, pipeline_class: str):
        self.model_dir = Path(model_dir)
        self.pipeline_class_name = pipeline_class

    # -- components -----------------------------------------------------------------------------------
    def pipeline_class(self):
        """The stock Diffusers pipeline class: what this family's served results are checked against."""
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def pipeline_kwargs(self) -> dict:
        """Extra ``from_pretrained`` arguments for the stock pipeline (e.g. no safety checker)."""
        return {}

    @abstractmethod
    def load_denoiser(self, settings):
        """The denoiser module on ``settings``' device and dtype (generated weights for generated presets)."""

    @abstractmethod
    def geometry(self, settings) -> Geometry: ...

    # -- pre-processing (stage 1) ---------------------------------------------------------------------
    @abstractmethod
    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        """Tokens of ``prompt`` in the encoder whose length is limited (checked against max_sequence_length)."""

    @abstractmethod
    def prepare(self, pipe, scheduler_config: dict, image, mask, token_mask, w: int, h: int, params,
                settings) -> Prepared:
        """The tensors of one edit, mirroring the stock pipeline's ``__call__`` so results equal it for the same
        seed. ``image`` (1, 3, h, w) from the pipeline's image processor, ``mask`` (1, 1, h, w) in {0, 1} from its
        mask processor, ``token_mask`` (tokens,) bool: the tokens the edit touches."""

    # -- the denoise loop (stage 2) ---------------------------------------------------------------------
    def check_scheduler(self, scheduler_config: dict) -> None:
        """Refuse at start-up a scheduler this family cannot run per request."""

    @abstractmethod
    def prepare_job(self, runner, job) -> None:
        """Admit a request: its latents, conditioning tensors (``JobTensors``) and scheduler on the device."""

    @abstractmethod
    def group_key(self, job):
        """Requests with equal keys share one denoiser call."""

    @abstractmethod
    def step(self, runner, group: list, ctx) -> None:
        """Advance ``group`` one step: one denoiser call (through ``ctx``'s cache hooks when given), then each
        request's scheduler step; increments each job's ``step_index``."""

    @abstractmethod
    def cache_hooks(self, denoiser):
        """The mask-aware block hooks on ``denoiser`` (a ``maskedit.cache.hooks.BlockHooks``)."""

    def flop_text(self, text: int, n: int) -> int:
        """Tokens a block always computes besides the ``n`` image tokens, for the FLOP model and the kernel ceiling
        (``maskedit_common.flops``): the text, and anything else every mode computes in full."""
        return text

    # -- LoRA adapters (``maskedit.adapters``) ------------------------------------------------------------
    # Adapters run as unmerged deltas on the denoiser's linear layers (hooks on the layers, so any family's
    # plain forward carries them). A family's mask-aware (cached) block paths must add them too: say which request
    # each layer input row belongs to (``delta.owners``) and add the deltas of projections computed with stacked
    # weights (``delta.add_fused``). Until a family's hooks do, its adapter requests run uncached (``off``).
    adapters_in_masked_path: ClassVar[bool] = False

    def lora_prefix(self) -> str:
        """Where the denoiser's keys start in the stock pipeline's LoRA state dict (``transformer``, ``unet``)."""
        return self.denoiser

    def lora_loader_kwargs(self, denoiser) -> dict:
        """Extra arguments the stock pipeline's ``load_lora_weights`` passes its ``lora_state_dict`` (e.g. SDXL's
        ``unet_config``, which maps kohya's SGM block numbers)."""
        return {}

    # -- decoding (stage 3) -----------------------------------------------------------------------------
    def setup_decoder(self, vae) -> None:
        """Adjust the VAE for decoding as the stock pipeline does (e.g. upcast)."""

    @abstractmethod
    def decode(self, pipe, latents, w: int, h: int):
        """Latent rows (1, tokens, C) on the VAE's device to a PIL image at model resolution."""

    # -- presets ----------------------------------------------------------------------------------------
    presets: ClassVar[dict[str, Any]] = {}  # tiny (tests, demo), bench (CPU benchmarks), real-size (GPU)
    tiny_preset: ClassVar[str] = "tiny"  # what `make model FAMILY=<name>` builds

    @classmethod
    def dir_name(cls, preset: str) -> str:
        """The directory a preset's model is built in under ``models/`` by default."""
        return preset

    @classmethod
    @abstractmethod
    def build(cls, out_dir: str | Path, preset: str, seed: int = 0) -> Path:
        """Write a model directory for ``preset`` with seeded random weights (``save_pretrained``)."""
