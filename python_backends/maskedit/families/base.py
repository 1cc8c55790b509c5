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
    # An in-context edit model's reference images beyond the template (``ModelFamily.prepare_references``): their
    # tokens (R, C) in the family's layout and each image's token grid (rows, cols); None / () without any.
    reference: Any = None
    reference_grids: tuple = ()


class ModelFamily(ABC):
    """One model family. Instances are per model directory (``REGISTRY.family(model_dir)``)."""

    name: ClassVar[str]  # the registry's name, also ``make demo FAMILY=<name>``
    pipeline_classes: ClassVar[tuple[str, ...]]  # ``model_index.json`` ``_class_name`` values this family serves
    denoiser: ClassVar[str] = "transformer"  # the denoiser's component / subfolder name
    text_components: ClassVar[tuple[str, ...]] = ("text_encoder",)  # left out of processes that do not encode
    negative_prompt: ClassVar[bool] = False  # does the family use a negative prompt (classifier-free guidance)?
    # Does its stock pipeline put the template (noised to the next timestep) back outside the mask after every step?
    # Then an unmasked token's input at a timestep does not depend on the step the schedule started at, and one
    # entry serves every STRENGTH (docs/caching.md, "Strength"); otherwise the first step is in the cache key.
    blends_unmasked: ClassVar[bool] = False

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

    def model_size(self, width: int, height: int, settings) -> tuple[int, int]:
        """The (w, h) a ``width`` x ``height`` template is edited at: by default about ``settings.resolution**2``
        pixels, the aspect kept, sides multiples of the geometry's ``multiple``. A family whose stock pipeline sizes
        its images its own way says so here (Qwen-Image-Edit: ``calculate_dimensions``, rounded down)."""
        from ..imaging import model_size

        return model_size(width, height, settings.resolution, multiple=self.geometry(settings).multiple)

    # -- pre-processing (stage 1) ---------------------------------------------------------------------
    @abstractmethod
    def count_prompt_tokens(self, pipe, prompt: str) -> int:
        """Tokens of ``prompt`` in the encoder whose length is limited (checked against max_sequence_length)."""

    def prompt_cache(self, settings):
        """Pre-processing's cache of encoded prompts where the family keeps one (``hits``, ``misses``, ``nbytes``;
        the ``preprocess`` model exports them as ``maskedit_prompt_cache_*`` metrics), else None."""
        return None

    @abstractmethod
    def prepare(self, pipe, scheduler_config: dict, image, mask, token_mask, w: int, h: int, params,
                settings) -> Prepared:
        """The tensors of one edit, mirroring the stock pipeline's ``__call__`` so results equal it for the same
        seed. ``image`` (1, 3, h, w) from the pipeline's image processor, ``mask`` (1, 1, h, w) in {0, 1} from its
        mask processor, ``token_mask`` (tokens,) bool: the tokens the edit touches."""

    # -- reference images (in-context edit models) -------------------------------------------------------
    # A request may carry up to ``max_reference_images`` images (``REFERENCE_IMAGES``; the deployment's
    # ``max_reference_images`` caps it too) beside its template: the stock pipeline's reference argument
    # (``image_reference``). Pre-processing decodes them (errors name the field), puts them in the cache key, and
    # turns them into the denoiser's reference tokens with ``prepare_references``; they reach the family's
    # ``prepare_job`` as ``DenoiseInputs.reference`` / ``reference_grids``, and its cache hooks count them among the
    # entry's rows (``BlockHooks.reference_tokens``). 0: the family takes none (requests naming one are refused).
    max_reference_images: ClassVar[int] = 0

    def prepare_references(self, pipe, images: list, w: int, h: int, settings, crop=None) -> tuple[Any, tuple]:
        """The reference images (PIL RGB, at least one) as (tokens (R, C), each image's token grid (rows, cols)),
        handled as the stock pipeline handles its reference argument at model size ``w`` x ``h``. ``crop``: with
        PADDING_MASK_CROP, the template's crop box (x1, y1, x2, y2) in a ``w`` x ``h`` frame (the references are
        taken as aligned with the template), for a stock pipeline that crops its references too."""
        raise NotImplementedError(f"{self.name} takes no reference images")

    # -- the stock pipelines' options (docs/api.md, "Diffusers parameters") -------------------------------
    def served_options(self) -> frozenset[str]:
        """Which of the options only some stock pipelines have this family serves (``guidance_rescale``,
        ``true_cfg_scale``): those its stock pipeline's ``__call__`` takes."""
        return frozenset()

    def uses_negative_prompt(self, params) -> bool:
        """Does this request's NEGATIVE_PROMPT change its result? (A family without classifier-free guidance
        refuses one rather than ignoring it.)"""
        return self.negative_prompt

    def check_options(self, params) -> None:
        """Refuse an option this family's stock pipeline does not have, set to a value that would change the result
        (``InvalidInput`` naming its field): silently ignoring it would give another image than the user asked for."""
        from ..errors import InvalidInput

        served = self.served_options()
        # each option's value at or below which the stock pipelines that have it do nothing with it
        for attr, field, idle in (("guidance_rescale", "GUIDANCE_RESCALE", 0.0),
                                  ("true_cfg_scale", "TRUE_CFG_SCALE", 1.0)):
            if attr not in served and getattr(params, attr, idle) > idle:
                raise InvalidInput(f"is not a parameter of {self.pipeline_class_name}; leave it at {idle:g} or "
                                   "below", field)

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

    def runs_cached(self, inputs) -> bool:
        """May this request (``denoise.DenoiseInputs``) take the mask-aware path? A request the family's hooks cannot
        serve (e.g. classifier-free guidance where the hooks record one row per request) runs with the cache off,
        like adapters a family's masked path does not add. Default: every request."""
        return True

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
    # Whether requests with ControlNets are cached: the ControlNet's blocks behind the cache's hooks (its rows
    # recorded and reused, ``maskedit.cache.controlnet``) and its residuals taken by the masked path. Until a
    # family's are, its requests with controls run uncached (``off``).
    controls_in_masked_path: ClassVar[bool] = False
    # Temporal reuse (``maskedit.temporal``): the family's block hooks consult the step context's ``temporal`` call
    # (skipped rows pass a middle block through; ``enter`` / ``exit`` around every block) and say which image
    # tokens a hit computes (``temporal_cols``). Until they do, requests with a TEMPORAL policy are refused.
    temporal_reuse: ClassVar[bool] = False

    def temporal_hooks(self, denoiser):
        """The hooks that carry temporal reuse out (their ``blocks`` are what ``fn`` / ``bn`` count): the mask-aware
        block hooks by default."""
        return self.cache_hooks(denoiser)

    def lora_prefix(self) -> str:
        """Where the denoiser's keys start in the stock pipeline's LoRA state dict (``transformer``, ``unet``)."""
        return self.denoiser

    def lora_loader_kwargs(self, denoiser) -> dict:
        """Extra arguments the stock pipeline's ``load_lora_weights`` passes its ``lora_state_dict`` (e.g. SDXL's
        ``unet_config``, which maps kohya's SGM block numbers)."""
        return {}

    # -- ControlNets (``maskedit.controlnets``; docs/controlnet.md) ----------------------------------------
    # A request names up to ``max_controls`` ControlNets from the library, each with one control image. The
    # library (``controlnets.library``) loads a ControlNet with ``load_controlnet`` (once, shared by requests);
    # pre-processing turns each control image into the family's conditioning tensor with
    # ``prepare_control_image``; the runner admits a job with ``job.controls`` (``controlnets.job.ActiveControl``:
    # the loaded model, the prepared image on the device, the spec with scale/start/end/mode). The family's
    # ``step`` computes, per job and step, each active control's residuals with ``control_residuals`` at
    # ``spec.scale_at(step_index, steps)`` (skipped at 0: the pipelines add zeros), sums a job's controls as
    # Diffusers' Multi-ControlNet does, and adds the sums to the denoiser's call (jobs without controls in the same
    # call get none). A family that runs no ControlNets leaves ``controlnet_classes`` empty: requests naming one
    # are refused.
    controlnet_classes: ClassVar[tuple[str, ...]] = ()  # ControlNet ``config.json`` ``_class_name`` values it runs
    union_controlnet_classes: ClassVar[tuple[str, ...]] = ()  # those taking a control ``mode`` (union models)

    def controlnet_union(self, config: dict) -> bool:
        """Does the ControlNet with this ``config.json`` take a control mode? (Flux's union and plain ControlNets
        are one class, told apart by their config.)"""
        return config.get("_class_name") in self.union_controlnet_classes

    def control_mode_index(self, mode: str, config: dict) -> int:
        """The index a union ControlNet takes for control mode ``mode`` (its training's numbering: xinsir's SDXL
        union by default); ``ValueError`` (a reason) when it has no such mode."""
        from maskedit_common.controls import UNION_MODES

        index, n_modes = UNION_MODES[mode], config.get("num_control_type")
        if n_modes is not None and index >= n_modes:
            raise ValueError(f"mode {mode!r} is number {index} and it has {n_modes} modes")
        return index

    def load_controlnet(self, path: Path, settings):
        """The ControlNet saved at ``path`` (``save_pretrained``'s layout) on ``settings``' device and dtype, loaded
        with ``from_pretrained`` of the class its config names. Raises ``ValueError`` with a reason the library
        reports (naming CONTROLS) when this family cannot run it (another family's ControlNet, other widths)."""
        import json

        import diffusers

        from ..device import torch_dtype

        from maskedit_common.regular_files import read_regular

        cls_name = json.loads(read_regular(Path(path) / "config.json")).get("_class_name")
        if cls_name not in self.controlnet_classes:
            runs = ", ".join(self.controlnet_classes) or "none"
            raise ValueError(f"is a {cls_name} and {self.pipeline_class_name} models run {runs}")
        model = getattr(diffusers, cls_name).from_pretrained(path, torch_dtype=torch_dtype(settings))
        return model.to(settings.torch_device).eval()

    def check_controlnet(self, controlnet, denoiser) -> None:
        """Raise ``ValueError`` (a reason) when ``controlnet`` does not fit ``denoiser`` (e.g. its text width)."""

    def prepare_control_image(self, pipe, image, w: int, h: int, settings, crop=None):
        """One control image (a PIL RGB image, the preprocessor already applied) as the tensor the family's
        ControlNet takes at model size ``w`` x ``h`` — resized and normalised (and VAE-encoded / packed where the
        family's pipeline does so) exactly as the stock ControlNet pipeline's ``prepare_control_image`` /
        ``prepare_image``, for one image and no guidance doubling (the step repeats it per guidance row). Runs in
        pre-processing; the result travels as one ``CONTROL_COND`` row and is restored with its shape. ``crop``:
        with PADDING_MASK_CROP, the template's crop box (x1, y1, x2, y2) in the template's own pixels (the stock
        pipelines' ``crops_coords``); the family does with it what its stock ControlNet pipeline does."""
        raise NotImplementedError(f"{self.name} runs no ControlNets")

    def control_residuals(self, control, inputs: dict, scale: float) -> list:
        """One ControlNet call for one job's rows: ``control`` an ``ActiveControl``, ``inputs`` the denoiser's call
        arguments for those rows (the family's names), ``scale`` the conditioning scale at this step. Returns the
        residuals as a flat list of tensors (the unit a BLS ``controlnet`` model returns), already scaled."""
        raise NotImplementedError(f"{self.name} runs no ControlNets")

    def remote_residuals(self, actives: list, inputs: dict) -> tuple[list, list[int]]:
        """The ``controlnet`` model's work for one job at one step (placement ``triton``): ``actives`` its
        (ActiveControl, scale) acting at this step, in control order. Returns the residuals as one flat list and how
        many belong to each of the family's lists (``wire.pack_residuals``' groups). Default: each control's
        ``control_residuals`` summed in order as Diffusers' ``MultiControlNetModel`` sums them, one list."""
        total = None
        for control, scale in actives:
            res = self.control_residuals(control, inputs, scale)
            total = res if total is None else [a + b for a, b in zip(total, res)]
        return total, [len(total)]

    def build_controlnets(self, out: Path, seed: int = 0) -> list[Path]:
        """Seeded random ControlNets for this (tiny) model, the family's layout scaled to its denoiser, written to
        ``out/<name>/`` with ``save_pretrained`` (``maskedit-build-model``, ``make model``). None by default."""
        return []

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
