"""The ``CONTROLS`` request input: a JSON list of ControlNet controls, parsed and checked the same way by the
backend and the router, and the rule tying it to ``CONTROL_IMAGES`` (one image per control, in order).

A control is ``{"name": ..., "scale": 1.0, "start": 0.0, "end": 1.0, "mode": "canny", "preprocess": "canny"}``:
``name`` a ControlNet in the configured library (a name, never a path); ``scale`` its conditioning scale (the
pipelines' ``controlnet_conditioning_scale``, 0..max); ``start`` / ``end`` the fraction of the schedule it acts on
(``control_guidance_start`` / ``control_guidance_end``); ``mode`` a union ControlNet's control mode (``UNION_MODES``;
only for union models); ``preprocess`` an optional server-side preprocessor turning a photo into the map the
ControlNet expects (``PREPROCESSORS``). An object alone is one control; a string alone is a name at scale 1."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from . import json_field
from .loras import NAME

FIELD = "CONTROLS"
IMAGES = "CONTROL_IMAGES"
# Union ControlNets' control modes (xinsir's controlnet-union-sdxl-1.0 / promax, the numbering Diffusers'
# ``StableDiffusionXLControlNetUnionInpaintPipeline`` documents): several names share an index.
UNION_MODES = {"openpose": 0, "pose": 0, "depth": 1, "hed": 2, "pidi": 2, "scribble": 2, "ted": 2, "canny": 3,
               "lineart": 3, "anime_lineart": 3, "mlsd": 3, "normal": 4, "segment": 5, "tile": 6, "repaint": 7}
PREPROCESSORS = ("canny",)  # server-side: a photo to an edge map (OpenCV)
_KEYS = {"name", "scale", "start", "end", "mode", "preprocess"}


class ControlSpecError(ValueError):
    """A malformed ``CONTROLS`` / ``CONTROL_IMAGES`` value; ``field`` is the Triton input, ``index`` the control."""

    def __init__(self, message: str, field: str = FIELD, index: int | None = None):
        super().__init__(message if index is None else f"control {index}: {message}")
        self.field = field
        self.index = index


@dataclass(frozen=True)
class ControlSpec:
    name: str
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mode: str | None = None  # a union ControlNet's control mode name (``UNION_MODES``)
    preprocess: str | None = None  # a server-side preprocessor (``PREPROCESSORS``), None: the image is the map

    @property
    def mode_index(self) -> int | None:
        return None if self.mode is None else UNION_MODES[self.mode]

    def scale_at(self, step: int, steps: int) -> float:
        """The conditioning scale at ``step`` of ``steps``: the pipelines' ``controlnet_keep`` (0 outside
        [start, end] of the schedule) times ``scale``."""
        keep = 1.0 - float(step / steps < self.start or (step + 1) / steps > self.end)
        return self.scale * keep

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _number(it: dict, key: str, default: float, i: int) -> float:
    v = it.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ControlSpecError(f"{key} must be a number, got {v!r:.40}", index=i)
    return float(v)


def parse(value, max_controls: int = 2, max_scale: float = 4.0) -> tuple[ControlSpec, ...]:
    """``value``: JSON text (or the decoded list / object). Empty or absent: no controls."""
    value = json_field.decode(value, ControlSpecError)
    if value is None:
        return ()
    items = [value] if isinstance(value, (dict, str)) else value
    if isinstance(items, tuple):
        items = list(items)
    if not isinstance(items, list):
        raise ControlSpecError(f'must be a list of {{"name", "scale", "start", "end"}} objects, got '
                               f'{type(value).__name__}')
    if len(items) > max_controls:
        raise ControlSpecError(f"names {len(items)} controls, above the limit of {max_controls}")
    out = []
    for i, it in enumerate(items):
        if isinstance(it, ControlSpec):
            it = it.as_dict()
        if isinstance(it, str):
            it = {"name": it}
        if not isinstance(it, dict) or "name" not in it:
            raise ControlSpecError('must be an object with "name" (and optionally "scale", "start", "end", "mode", '
                                   '"preprocess")', index=i)
        extra = set(it) - _KEYS
        if extra:
            raise ControlSpecError(f"has unknown keys {sorted(extra)}", index=i)
        name = it["name"]
        if not isinstance(name, str) or not NAME.match(name):
            raise ControlSpecError(f"{name!r:.60} is not a ControlNet name (letters, digits, '.', '_', '-'; names, "
                                   "not paths)", index=i)
        scale = _number(it, "scale", 1.0, i)
        if not 0 <= scale <= max_scale:
            raise ControlSpecError(f"scale must be between 0 and {max_scale}, got {scale}", index=i)
        start, end = _number(it, "start", 0.0, i), _number(it, "end", 1.0, i)
        if not (0 <= start <= 1 and 0 <= end <= 1):
            raise ControlSpecError(f"start and end must lie in [0, 1], got start {start}, end {end}", index=i)
        if start >= end:
            raise ControlSpecError(f"start ({start}) must be below end ({end})", index=i)
        mode = it.get("mode")
        if mode is not None and mode not in UNION_MODES:
            raise ControlSpecError(f"mode {mode!r:.40} is not a control mode; known: {', '.join(UNION_MODES)}",
                                   index=i)
        pre = it.get("preprocess")
        if pre in ("", "none"):
            pre = None
        if pre is not None and pre not in PREPROCESSORS:
            raise ControlSpecError(f"preprocess {pre!r:.40} is not a preprocessor; known: {', '.join(PREPROCESSORS)}",
                                   index=i)
        out.append(ControlSpec(name, scale, start, end, mode, pre))
    return tuple(out)


def check_images(specs, count: int) -> None:
    """One control image per control, in order: a ControlNet named without its image, or an image without a name,
    is refused (naming the field that lacks the entry)."""
    n = len(specs)
    if count < n:
        raise ControlSpecError(f"has no image for ControlNet {specs[count].name!r} (CONTROL_IMAGES holds {count}, "
                               f"CONTROLS names {n}): send one control image per control, in order", IMAGES,
                               index=count)
    if count > n:
        raise ControlSpecError(f"names no ControlNet for this image (CONTROL_IMAGES holds {count}, CONTROLS names "
                               f"{n}): name a ControlNet for each image", FIELD, index=n)


def encode(specs) -> str:
    """The JSON text of ``specs`` (``ControlSpec`` or dicts), as the ``CONTROLS`` input carries it."""
    specs = [s if isinstance(s, ControlSpec) else ControlSpec(**s) for s in specs]
    return json.dumps([s.as_dict() for s in specs]) if specs else ""


def library_names(root) -> list[str]:
    """The ControlNet names in library directory ``root``: subdirectories holding a ``config.json`` (as
    ``save_pretrained`` writes a ControlNet)."""
    from pathlib import Path

    root = Path(root)
    if not root.is_dir():
        return []
    return [p.name for p in sorted(root.iterdir()) if p.is_dir() and NAME.match(p.name)
            and (p / "config.json").is_file()]
