"""Load the components each stage needs, from a local model directory, with stock Diffusers.

The model family is read from the directory's ``model_index.json`` as ``from_pretrained`` does (``maskedit.families``
maps the pipeline class to the family). Each Triton model loads only its own parts (``from_pretrained(dir,
transformer=None)`` and so on), so the text encoders never sit in the denoise process and the denoiser never sits
in the pre/post-processing processes.
"""

from __future__ import annotations

import logging

from .device import torch_dtype
from .settings import Settings

__all__ = ["family", "load_pipeline", "load_scheduler_config", "load_transformer", "torch_dtype"]
log = logging.getLogger(__name__)


def family(settings: Settings):
    """The model family serving ``settings.model_dir`` (``maskedit.families``)."""
    from .families import family_for

    return family_for(settings.model_dir)


def load_pipeline(settings: Settings, with_transformer: bool = False, with_text: bool = True, with_vae: bool = True):
    """The model directory's stock pipeline holding only the requested components (others are ``None``).
    ``with_transformer``: the denoiser (a transformer or a UNet)."""
    fam = family(settings)
    skip = {}
    if not with_transformer:
        skip[fam.denoiser] = None
    if not with_text:
        skip.update({name: None for name in fam.text_components})
    if not with_vae:
        skip["vae"] = None
    pipe = fam.pipeline_class().from_pretrained(settings.model_dir, dtype=torch_dtype(settings), **skip,
                                                **fam.pipeline_kwargs())
    pipe.set_progress_bar_config(disable=True)
    pipe.to(settings.torch_device)
    log.info("loaded %s from %s on %s", sorted(k for k in pipe.components if pipe.components[k] is not None),
             settings.model_dir, settings.torch_device)
    return pipe


def load_transformer(settings: Settings):
    """The denoiser (Flux transformer, UNet, ...) on the settings' device and dtype."""
    return family(settings).load_denoiser(settings)


def load_scheduler_config(settings: Settings) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    family(settings)  # a clear error when there is no model; any ConfigMixin reads the scheduler's config
    return dict(FlowMatchEulerDiscreteScheduler.load_config(settings.model_dir, subfolder="scheduler"))
