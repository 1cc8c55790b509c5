"""The model families this server serves, by name. Adding a family is one subpackage implementing
``base.ModelFamily`` and one line here (docs/architecture.md, "Adding a model family"). This registry is the only
place that knows which families exist; everything else asks it for the family of a model directory.
"""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from pathlib import Path

from .base import ModelFamily

# name -> "module:class". Imported on first use: a process loads only the family it serves.
REGISTRY = {
    "flux_fill": "maskedit.families.flux_fill:FluxFill",
    "unet_inpaint": "maskedit.families.unet_inpaint:UNetInpaint",
    "flux2_klein": "maskedit.families.flux2_klein:Flux2KleinFamily",
    "flux_controlnet": "maskedit.families.flux_controlnet:FluxControlNetFamily",
    "qwen_image_edit": "maskedit.families.qwen_image_edit:QwenImageEditFamily",
    "flux_kontext": "maskedit.families.flux_kontext:FluxKontextFamily",
}


def family_class(name: str) -> type[ModelFamily]:
    if name not in REGISTRY:
        raise ValueError(f"unknown model family {name!r}; served: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def pipeline_classes() -> dict[str, str]:
    """``model_index.json`` class name -> family name, for every registered family."""
    return {p: name for name in REGISTRY for p in family_class(name).pipeline_classes}


@lru_cache(maxsize=16)
def _for(model_dir: str) -> ModelFamily:
    index = Path(model_dir) / "model_index.json"
    if not index.exists():
        raise FileNotFoundError(
            f"no model at {model_dir}: build the tiny default with `make model` or set MASKEDIT_MODEL_DIR")
    pipeline = json.loads(index.read_text()).get("_class_name")
    served = pipeline_classes()
    if pipeline not in served:
        raise ValueError(f"{model_dir}: pipeline {pipeline!r} is not served; supported: {', '.join(served)}")
    return family_class(served[pipeline])(model_dir, pipeline)


def family_for(model_dir) -> ModelFamily:
    """The family serving the model directory (from the pipeline class its ``model_index.json`` names)."""
    return _for(str(Path(model_dir).resolve()))


def preset_family(preset: str) -> type[ModelFamily]:
    """The family whose presets include ``preset`` (preset names are unique across families)."""
    for name in REGISTRY:
        cls = family_class(name)
        if preset in cls.presets:
            return cls
    raise ValueError(f"unknown preset {preset!r}; known: {', '.join(all_presets())}")


def all_presets() -> list[str]:
    return [p for name in REGISTRY for p in family_class(name).presets]
