"""The ``LORAS`` request input: a JSON list of ``{"name": ..., "scale": ...}`` (an object alone is one adapter),
parsed and checked the same way by the backend and the router. Names are adapter names in the configured library,
never paths."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from . import json_field

FIELD = "LORAS"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # no separators, no leading dot: never a path


class LoraSpecError(ValueError):
    """A malformed ``LORAS`` value; ``field`` is the Triton input."""

    field = FIELD


@dataclass(frozen=True)
class LoraRef:
    name: str
    scale: float = 1.0


def parse(value, max_loras: int = 4, max_scale: float = 4.0) -> tuple[LoraRef, ...]:
    """``value``: JSON text (or the decoded list / object). Empty or absent: no adapters."""
    value = json_field.decode(value, LoraSpecError)
    if value is None:
        return ()
    items = [value] if isinstance(value, dict) else value
    if isinstance(items, tuple):
        items = list(items)
    if not isinstance(items, list):
        raise LoraSpecError(f'must be a list of {{"name", "scale"}} objects, got {type(value).__name__}')
    if len(items) > max_loras:
        raise LoraSpecError(f"names {len(items)} adapters, above the limit of {max_loras}")
    out, seen = [], set()
    for i, it in enumerate(items):
        if isinstance(it, str):
            it = {"name": it}
        if not isinstance(it, dict) or "name" not in it:
            raise LoraSpecError(f'entry {i} must be an object with "name" (and optionally "scale")')
        extra = set(it) - {"name", "scale", "weight"}
        if extra:
            raise LoraSpecError(f"entry {i} has unknown keys {sorted(extra)}")
        name = it["name"]
        if not isinstance(name, str) or not NAME.match(name):
            raise LoraSpecError(f"adapter name {name!r:.60} is not an adapter name (letters, digits, '.', '_', '-'; "
                                "names, not paths)")
        scale = it.get("scale", it.get("weight", 1.0))
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise LoraSpecError(f"adapter {name!r}: scale must be a number, got {scale!r:.40}")
        if abs(scale) > max_scale:
            raise LoraSpecError(f"adapter {name!r}: scale must be between {-max_scale} and {max_scale}, got {scale}")
        if name in seen:
            raise LoraSpecError(f"adapter {name!r} is named twice")
        seen.add(name)
        out.append(LoraRef(name, float(scale)))
    return tuple(out)


def encode(refs) -> str:
    """The JSON text of ``refs`` (``LoraRef`` or ``(name, scale)``), as the ``LORAS`` input carries it."""
    refs = [r if isinstance(r, LoraRef) else LoraRef(*r) for r in refs]
    return json.dumps([{"name": r.name, "scale": r.scale} for r in refs]) if refs else ""


def library_names(root) -> list[str]:
    """The adapter names in library directory ``root``: ``<name>/`` holding a ``.safetensors`` file (Diffusers /
    PEFT) or ``<name>.safetensors`` (kohya)."""
    from pathlib import Path

    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and NAME.match(p.name) and any(p.glob("*.safetensors")):
            out.append(p.name)
        elif p.is_file() and p.suffix == ".safetensors" and NAME.match(p.stem):
            out.append(p.stem)
    return out

