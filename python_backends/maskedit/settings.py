"""Serving settings: where the model is and the limits every request is checked against.

Defaults come from the model directory's ``maskedit.json`` (written by the tiny-model builder; optional
for real weights) and can be overridden by ``MASKEDIT_*`` environment variables, so the same
model repository serves the tiny default and real Flux Fill weights without edits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

SERVING_DEFAULTS_FILE = "maskedit.json"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tiny-flux-fill"


@dataclass(frozen=True)
class Settings:
    model_dir: Path = DEFAULT_MODEL_DIR
    resolution: int = 1024  # model works at about resolution**2 pixels, aspect kept, sides multiple of 16
    steps: int = 50  # default STEPS
    guidance: float = 30.0  # default GUIDANCE (Flux Fill's embedded guidance)
    max_sequence_length: int = 512  # T5 tokens; longer prompts are rejected
    max_steps: int = 100
    max_guidance: float = 100.0
    max_prompt_chars: int = 2000
    max_input_pixels: int = 4096 * 4096  # per image, checked from the header before decoding
    feather_px: int = 4  # soft edge of the compositing mask, in template pixels
    mask_threshold: int = 128  # mask pixels >= this (grayscale 0..255) are edited
    dtype: str = "float32"
    device: str = "auto"

    @property
    def torch_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


_ENV = {
    "MASKEDIT_RESOLUTION": ("resolution", int),
    "MASKEDIT_STEPS": ("steps", int),
    "MASKEDIT_GUIDANCE": ("guidance", float),
    "MASKEDIT_MAX_SEQUENCE_LENGTH": ("max_sequence_length", int),
    "MASKEDIT_MAX_STEPS": ("max_steps", int),
    "MASKEDIT_MAX_INPUT_PIXELS": ("max_input_pixels", int),
    "MASKEDIT_FEATHER_PX": ("feather_px", int),
    "MASKEDIT_DTYPE": ("dtype", str),
    "MASKEDIT_DEVICE": ("device", str),
}


def load_settings(env: dict | None = None) -> Settings:
    env = os.environ if env is None else env
    model_dir = Path(env.get("MASKEDIT_MODEL_DIR", DEFAULT_MODEL_DIR))
    s = Settings(model_dir=model_dir)
    s = replace(s, **_family_defaults(model_dir))
    defaults_file = model_dir / SERVING_DEFAULTS_FILE
    if defaults_file.exists():
        known = {k: v for k, v in json.loads(defaults_file.read_text()).items() if k in Settings.__dataclass_fields__}
        s = replace(s, **known)
    for var, (field, cast) in _ENV.items():
        if var in env:
            s = replace(s, **{field: cast(env[var])})
    return s


def _family_defaults(model_dir: Path) -> dict:
    """Defaults of an SD 2 / SDXL inpainting directory without a ``maskedit.json``: classifier-free guidance 7.5
    (Flux's 30 is an embedded guidance), CLIP's 77 tokens, the model's native resolution."""
    index = model_dir / "model_index.json"
    try:
        name = json.loads(index.read_text()).get("_class_name") if index.exists() else None
    except (OSError, ValueError):
        return {}
    if name == "StableDiffusionXLInpaintPipeline":
        return {"guidance": 7.5, "max_sequence_length": 77, "resolution": 1024, "steps": 30}
    if name == "StableDiffusionInpaintPipeline":
        return {"guidance": 7.5, "max_sequence_length": 77, "resolution": 512, "steps": 50}
    return {}
