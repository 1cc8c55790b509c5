"""Per-request scalar parameters: defaults and range checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InvalidInput
from .settings import Settings

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class EditParams:
    prompt: str
    seed: int
    steps: int
    guidance: float
    raw_output: bool = False
    template_seed: int = 0  # noise of the unmasked tokens and VAE sampling of the template; part of the cache key
    register: bool = False  # run the template (no edit) to record its activations for later edits
    use_cache: bool = True  # False: full computation, nothing read from or written to the activation cache
    deadline_ms: int | None = None  # finish within this many ms of arrival, or fail with DEADLINE_EXCEEDED
    progress: bool = False  # stream "step i of N" responses before the image
    negative_prompt: str = ""  # SD 2 / SDXL: the guidance's negative row (their pipelines' ``negative_prompt``)


def parse_params(
    settings: Settings,
    prompt: bytes | str,
    seed: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    raw_output: bool | None = None,
    template_seed: int | None = None,
    register: bool | None = None,
    use_cache: bool | None = None,
    deadline_ms: int | None = None,
    progress: bool | None = None,
    negative_prompt: bytes | str | None = None,
) -> EditParams:
    prompt = _text(settings, prompt, "PROMPT")
    if not prompt.strip():
        raise InvalidInput("is empty; describe the edit", "PROMPT")
    negative_prompt = _text(settings, negative_prompt or "", "NEGATIVE_PROMPT")
    seed = 0 if seed is None else int(seed)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidInput(f"must be between 0 and {MAX_SEED}, got {seed}", "SEED")
    template_seed = 0 if template_seed is None else int(template_seed)
    if not 0 <= template_seed <= MAX_SEED:
        raise InvalidInput(f"must be between 0 and {MAX_SEED}, got {template_seed}", "TEMPLATE_SEED")
    steps = settings.steps if steps is None else int(steps)
    if not 1 <= steps <= settings.max_steps:
        raise InvalidInput(f"must be between 1 and {settings.max_steps}, got {steps}", "STEPS")
    guidance = settings.guidance if guidance is None else float(guidance)
    if not (math.isfinite(guidance) and 0.0 <= guidance <= settings.max_guidance):
        raise InvalidInput(f"must be between 0 and {settings.max_guidance}, got {guidance}", "GUIDANCE")
    if deadline_ms is not None:
        deadline_ms = int(deadline_ms)
        if not 1 <= deadline_ms <= 24 * 3600 * 1000:
            raise InvalidInput(f"must be between 1 and {24 * 3600 * 1000} ms, got {deadline_ms}", "DEADLINE_MS")
    return EditParams(prompt=prompt, seed=seed, steps=steps, guidance=guidance, raw_output=bool(raw_output),
                      template_seed=template_seed, register=bool(register),
                      use_cache=True if use_cache is None else bool(use_cache), deadline_ms=deadline_ms,
                      progress=bool(progress), negative_prompt=negative_prompt)


def _text(settings: Settings, value: bytes | str, field: str) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput("is not valid UTF-8 text", field) from None
    if len(value) > settings.max_prompt_chars:
        raise InvalidInput(f"has {len(value)} characters, above the limit of {settings.max_prompt_chars}", field)
    return value
