"""Load the Flux Fill components each stage needs, from a local directory, with stock Diffusers.

Each Triton model loads only its own parts (``FluxFillPipeline.from_pretrained(dir, transformer=None)``
and so on), so the text encoders never sit in the denoise process and the transformer never sits in
the pre/post-processing processes.
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


def load_pipeline(settings: Settings, with_transformer: bool = False, with_text: bool = True, with_vae: bool = True):
    """A ``FluxFillPipeline`` holding only the requested components (others are ``None``)."""
    from diffusers import FluxFillPipeline

    _check_dir(settings)
    skip = {}
    if not with_transformer:
        skip["transformer"] = None
    if not with_text:
        skip.update(text_encoder=None, text_encoder_2=None)
    if not with_vae:
        skip["vae"] = None
    pipe = FluxFillPipeline.from_pretrained(settings.model_dir, dtype=torch_dtype(settings), **skip)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(settings.torch_device)
    log.info("loaded %s from %s on %s", sorted(k for k in pipe.components if pipe.components[k] is not None),
             settings.model_dir, settings.torch_device)
    return pipe


def load_transformer(settings: Settings):
    from diffusers import FluxTransformer2DModel

    _check_dir(settings)
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


def _generated(settings: Settings) -> dict | None:
    import json

    from .settings import SERVING_DEFAULTS_FILE
    from .tiny_model import GENERATED_TRANSFORMER

    f = settings.model_dir / SERVING_DEFAULTS_FILE
    return json.loads(f.read_text()).get(GENERATED_TRANSFORMER) if f.exists() else None


def load_scheduler_config(settings: Settings) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    _check_dir(settings)
    return dict(FlowMatchEulerDiscreteScheduler.load_config(settings.model_dir, subfolder="scheduler"))


def vae_scale_factor(settings: Settings) -> int:
    from diffusers import AutoencoderKL

    cfg = AutoencoderKL.load_config(settings.model_dir, subfolder="vae")
    return 2 ** (len(cfg["block_out_channels"]) - 1)
