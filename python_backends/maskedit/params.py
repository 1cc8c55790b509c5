"""Per-request parameters, parsed and checked by the one declared schema (``maskedit_common.request_fields``)."""

from __future__ import annotations

from dataclasses import dataclass

from maskedit_common.controls import ControlSpecError
from maskedit_common.controls import parse as parse_controls
from maskedit_common.loras import LoraSpecError
from maskedit_common.loras import parse as parse_loras
from maskedit_common.request_fields import BY_ATTR, MAX_SEED, PARAMS, FieldError, check
from maskedit_common.temporal import OFF, TemporalSpec, TemporalSpecError
from maskedit_common.temporal import parse as parse_temporal

from .errors import InvalidInput
from .settings import Settings

__all__ = ["MAX_SEED", "EditParams", "parse_params"]


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
    loras: tuple = ()  # LoRA adapters (``maskedit_common.loras.LoraRef``: name, scale), parsed from LORAS' JSON
    controls: tuple = ()  # ControlNets (``maskedit_common.controls.ControlSpec``), parsed from CONTROLS' JSON
    temporal: TemporalSpec = OFF  # temporal reuse (``maskedit_common.temporal``), parsed from TEMPORAL's JSON
    # The stock pipelines' own parameters (docs/api.md, "Diffusers parameters")
    strength: float = 1.0  # the schedule starts steps - steps * strength into a noised template
    padding_mask_crop: int | None = None  # edit a crop around the mask (None: the whole template)
    guidance_rescale: float = 0.0  # SDXL's rescale of the guided noise prediction
    true_cfg_scale: float = 1.0  # FluxInpaintPipeline's classifier-free guidance with the negative prompt
    output_format: str = "png"  # the IMAGE's encoding: png, jpeg, webp
    output_quality: int = 95  # jpeg / webp quality


assert {f.attr for f in PARAMS} == set(EditParams.__dataclass_fields__), "EditParams and the schema must agree"


def parse_params(settings: Settings, prompt: bytes | str | None = None, **values) -> EditParams:
    """Every parameter by its schema field's rules (keywords: the fields' ``attr`` names; None or absent: the
    default). Bad values raise ``InvalidInput`` naming the Triton input."""
    unknown = set(values) - set(BY_ATTR)
    if unknown:
        raise TypeError(f"unknown request parameters {sorted(unknown)}")
    values["prompt"] = prompt
    try:
        out = {f.attr: check(f, values.get(f.attr), settings) for f in PARAMS}
    except FieldError as e:
        raise InvalidInput(str(e), e.field) from None
    try:
        out["loras"] = parse_loras(out["loras"], settings.max_loras, settings.max_lora_scale)
    except LoraSpecError as e:
        raise InvalidInput(str(e), e.field) from None
    try:
        out["controls"] = parse_controls(out["controls"], settings.max_controls, settings.max_control_scale)
    except ControlSpecError as e:
        raise InvalidInput(str(e), e.field) from None
    try:
        out["temporal"] = parse_temporal(out["temporal"], out["steps"])
    except TemporalSpecError as e:
        default = " (the server default MASKEDIT_TEMPORAL)" if values.get("temporal") is None else ""
        raise InvalidInput(f"{e}{default}", e.field) from None
    if out["prompt"] is None or not out["prompt"].strip():
        raise InvalidInput("is empty; describe the edit", "PROMPT")
    return EditParams(**out)
