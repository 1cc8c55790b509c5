"""Load the components each stage needs, from a local model directory, with stock Diffusers.

The model family is read from the directory's ``model_index.json`` as ``from_pretrained`` does: Flux Fill
(``FluxFillPipeline``), SD 2 inpainting (``StableDiffusionInpaintPipeline``) or SDXL inpainting
(``StableDiffusionXLInpaintPipeline``). Each Triton model loads only its own parts (``from_pretrained(dir,
transformer=None)`` and so on), so the text encoders never sit in the denoise process and the denoiser (Flux
transformer or UNet) never sits in the pre/post-processing processes.
"""

from __future__ import annotations

import logging

import torch

from .settings import Settings

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(settings: Settings) -> torch.dtype:
    return _DTYPES[settings.dtype]


def _check_dir(settings: Settings) -> None:
    if not (settings.model_dir / "model_index.json").exists():
        raise FileNotFoundError(
            f"no model at {settings.model_dir}: build the tiny default with `make model` or set MASKEDIT_MODEL_DIR"
        )


FLUX, SD, SDXL = "flux", "sd", "sdxl"
FAMILIES = {"FluxFillPipeline": FLUX, "StableDiffusionInpaintPipeline": SD, "StableDiffusionXLInpaintPipeline": SDXL}
_DENOISER = {FLUX: "transformer", SD: "unet", SDXL: "unet"}
_TEXT = {FLUX: ("text_encoder", "text_encoder_2"), SD: ("text_encoder",), SDXL: ("text_encoder", "text_encoder_2")}


def model_family(model_dir) -> str:
    """``flux`` / ``sd`` / ``sdxl``, from the pipeline class named in ``model_index.json``."""
    import json
    from pathlib import Path

    name = json.loads((Path(model_dir) / "model_index.json").read_text()).get("_class_name")
    if name not in FAMILIES:
        raise ValueError(f"{model_dir}: pipeline {name!r} is not served; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def is_unet(settings: Settings) -> bool:
    return model_family(settings.model_dir) != FLUX


def load_pipeline(settings: Settings, with_transformer: bool = False, with_text: bool = True, with_vae: bool = True):
    """The model directory's pipeline (Flux Fill, SD 2 or SDXL inpainting) holding only the requested components
    (others are ``None``). ``with_transformer``: the denoiser (Flux transformer or UNet)."""
    import diffusers

    _check_dir(settings)
    family = model_family(settings.model_dir)
    cls = getattr(diffusers, next(k for k, v in FAMILIES.items() if v == family))
    skip = {}
    if not with_transformer:
        skip[_DENOISER[family]] = None
    if not with_text:
        skip.update({name: None for name in _TEXT[family]})
    if not with_vae:
        skip["vae"] = None
    if family == SD:
        skip.update(safety_checker=None, requires_safety_checker=False)  # edits are composited into the template
    pipe = cls.from_pretrained(settings.model_dir, dtype=torch_dtype(settings), **skip)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(settings.torch_device)
    log.info("loaded %s from %s on %s", sorted(k for k in pipe.components if pipe.components[k] is not None),
             settings.model_dir, settings.torch_device)
    return pipe


def load_transformer(settings: Settings):
    """The denoiser: the Flux transformer, or the inpainting UNet of an SD 2 / SDXL directory."""
    from diffusers import FluxTransformer2DModel

    _check_dir(settings)
    if is_unet(settings):
        return _load_unet(settings)
    generated = _generated(settings)
    if generated is not None:  # a preset whose weights are generated on the device (tiny_model.PRESETS)
        from .tiny_model import generate_transformer

        log.info("generating the transformer of %s on %s (seed %s)", settings.model_dir, settings.torch_device,
                 generated["seed"])
        return generate_transformer(settings.model_dir, generated["seed"], settings.torch_device,
                                    torch_dtype(settings))
    model = FluxTransformer2DModel.from_pretrained(settings.model_dir, subfolder="transformer",
                                                   dtype=torch_dtype(settings))
    return model.to(settings.torch_device).eval()


def _load_unet(settings: Settings):
    from diffusers import UNet2DConditionModel

    from .tiny_unet import GENERATED_UNET, generate_unet

    generated = _generated(settings, GENERATED_UNET)
    if generated is not None:
        log.info("generating the UNet of %s on %s (seed %s)", settings.model_dir, settings.torch_device,
                 generated["seed"])
        return generate_unet(settings.model_dir, generated["seed"], settings.torch_device, torch_dtype(settings))
    model = UNet2DConditionModel.from_pretrained(settings.model_dir, subfolder="unet", dtype=torch_dtype(settings))
    return model.to(settings.torch_device).eval()


def _generated(settings: Settings, key: str | None = None) -> dict | None:
    import json

    from .settings import SERVING_DEFAULTS_FILE
    from .tiny_model import GENERATED_TRANSFORMER

    f = settings.model_dir / SERVING_DEFAULTS_FILE
    return json.loads(f.read_text()).get(key or GENERATED_TRANSFORMER) if f.exists() else None


def load_scheduler_config(settings: Settings) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    _check_dir(settings)  # any ConfigMixin reads the scheduler's config (its own class is in ``_class_name``)
    return dict(FlowMatchEulerDiscreteScheduler.load_config(settings.model_dir, subfolder="scheduler"))


def vae_scale_factor(settings: Settings) -> int:
    from diffusers import AutoencoderKL

    cfg = AutoencoderKL.load_config(settings.model_dir, subfolder="vae")
    return 2 ** (len(cfg["block_out_channels"]) - 1)
