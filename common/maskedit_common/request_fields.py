"""Every input of an edit, declared once: name, type, default and limits. The Triton ensemble's inputs are
generated from it (``maskedit.repository``), the server parses requests with it (``maskedit.params``), the OpenAI
endpoint reads its form fields by it (``maskedit_router.frontends.openai_form``), and a test holds the Python client's
arguments to it (the client ships without server code, so it cannot import this module).

A limit is a number, or the name of a ``Settings`` attribute that sets it per deployment (``max_steps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SEED = 2 ** 63 - 1


@dataclass(frozen=True)
class RequestField:
    name: str  # the Triton input
    attr: str  # the parameter's name everywhere else: EditParams, the client's keyword, the OpenAI form field
    kind: type  # bytes (an encoded image), str, int, float or bool
    dtype: str  # Triton TYPE_* without the prefix
    doc: str
    required: bool = False
    default: object = None  # the value when absent, unless ``default_setting`` gives it
    default_setting: str | None = None  # a Settings attribute holding the default
    lo: float | str | None = None  # lowest allowed (numbers)
    hi: float | str | None = None  # highest allowed (numbers); for text: most characters
    unit: str = ""  # said after the limits in errors ("ms")
    openai: bool = False  # also a form field of /v1/images/edits (``extra_body``), under ``attr``
    dims: tuple[int, ...] = (1,)  # the Triton input's shape: (1,) one value, (-1,) a list (CONTROL_IMAGES)
    choices: tuple[str, ...] = ()  # text: the values allowed (lower case; matched case-insensitively)

    @property
    def optional(self) -> bool:
        return not self.required

    def limits(self, settings) -> tuple:
        """(lo, hi) with settings' names resolved."""
        return tuple(getattr(settings, v) if isinstance(v, str) else v for v in (self.lo, self.hi))

    def default_for(self, settings):
        return getattr(settings, self.default_setting) if self.default_setting else self.default


REQUEST_FIELDS: tuple[RequestField, ...] = (
    RequestField("TEMPLATE", "template", bytes, "STRING", "the image to edit: PNG/JPEG/WebP bytes (or base64)",
                 required=True),
    RequestField("MASK", "mask", bytes, "STRING", "where to edit: white (>= the mask threshold) changes",
                 required=True),
    RequestField("PROMPT", "prompt", str, "STRING", "what the edited region should show", required=True,
                 hi="max_prompt_chars"),
    RequestField("NEGATIVE_PROMPT", "negative_prompt", str, "STRING", "SD 2 / SDXL: what to steer away from",
                 default="", hi="max_prompt_chars", openai=True),
    RequestField("SEED", "seed", int, "INT64", "noise of the edited tokens", default=0, lo=0, hi=MAX_SEED,
                 openai=True),
    RequestField("STEPS", "steps", int, "INT32", "denoising steps", default_setting="steps", lo=1, hi="max_steps",
                 openai=True),
    RequestField("GUIDANCE", "guidance", float, "FP32", "guidance scale", default_setting="guidance", lo=0,
                 hi="max_guidance", openai=True),
    RequestField("RAW_OUTPUT", "raw_output", bool, "BOOL", "the model's image without compositing", default=False),
    RequestField("TEMPLATE_SEED", "template_seed", int, "INT64", "noise of the unmasked tokens; in the cache key",
                 default=0, lo=0, hi=MAX_SEED, openai=True),
    RequestField("REGISTER", "register", bool, "BOOL", "run the template to record its activations",
                 default=False),
    RequestField("USE_CACHE", "use_cache", bool, "BOOL", "false: full computation, the cache neither read nor "
                 "written", default=True, openai=True),
    RequestField("DEADLINE_MS", "deadline_ms", int, "INT64", "finish within this many ms of arrival, or fail",
                 lo=1, hi=24 * 3600 * 1000, unit=" ms", openai=True),
    RequestField("PROGRESS", "progress", bool, "BOOL", "stream step progress before the image", default=False),
    RequestField("LORAS", "loras", str, "STRING", 'LoRA adapters by name from the adapter library, as JSON: '
                 '[{"name": "...", "scale": 0.8}] (at most max_loras; |scale| <= max_lora_scale)', default=(),
                 hi=8192),
    RequestField("CONTROLS", "controls", str, "STRING", 'ControlNets by name from the ControlNet library, as JSON: '
                 '[{"name": "...", "scale": 0.8, "start": 0, "end": 1, "mode": "canny", "preprocess": "canny"}] '
                 '(at most max_controls; 0 <= scale <= max_control_scale; one CONTROL_IMAGES entry each)',
                 default=(), hi=8192),
    RequestField("CONTROL_IMAGES", "control_images", bytes, "STRING", "one control image (PNG/JPEG bytes or "
                 "base64) per CONTROLS entry, in order", dims=(-1,)),
    RequestField("TEMPORAL", "temporal", str, "STRING", 'temporal reuse (step-to-step caching), as JSON: '
                 '{"policy": "fbcache", "threshold": 0.08}; policies fbcache, dbcache, taylorseer, steps, off '
                 '(docs/caching.md, "Temporal reuse"); empty: the server default', default_setting="temporal",
                 hi=4096, openai=True),
    RequestField("REFERENCE_IMAGES", "reference_images", bytes, "STRING", "in-context edit models (FLUX.2 [klein], "
                 "FLUX.1 Kontext): reference images (PNG/JPEG bytes or base64) the edit conditions on beside the "
                 "template, the stock pipeline's image_reference (at most max_reference_images; Kontext: one)",
                 dims=(-1,)),
    # The stock inpainting pipelines' own parameters (docs/api.md, "Diffusers parameters").
    # FP64: the pipelines truncate steps x strength to whole steps, so the user's own double decides the step count
    RequestField("STRENGTH", "strength", float, "FP64", "how far the masked region moves from the template: the "
                 "schedule starts at step steps - steps*strength of a noised template (the pipelines' strength)",
                 default=1.0, lo=0.0, hi=1.0, openai=True),
    RequestField("PADDING_MASK_CROP", "padding_mask_crop", int, "INT32", "edit a crop around the mask, this many "
                 "pixels wider each side, at the model's size, and paste it back (the pipelines' padding_mask_crop)",
                 lo=0, hi=1 << 20, unit=" px", openai=True),
    RequestField("GUIDANCE_RESCALE", "guidance_rescale", float, "FP32", "SDXL: rescale the guided noise "
                 "prediction toward the text one's deviation (the pipeline's guidance_rescale)", default=0.0, lo=0.0,
                 hi=1.0, openai=True),
    RequestField("TRUE_CFG_SCALE", "true_cfg_scale", float, "FP32", "Flux inpainting (FluxInpaintPipeline) and "
                 "FLUX.1 Kontext: classifier-free guidance with NEGATIVE_PROMPT when above 1 (a second transformer row)",
                 default=1.0, lo=0.0, hi="max_guidance", openai=True),
    RequestField("OUTPUT_FORMAT", "output_format", str, "STRING", "the IMAGE's encoding: png, jpeg or webp",
                 default="png", hi=8, openai=True, choices=("png", "jpeg", "webp")),
    RequestField("OUTPUT_QUALITY", "output_quality", int, "INT32", "jpeg / webp quality (png: ignored; lossless)",
                 default=95, lo=1, hi=100, openai=True),
)
BY_NAME = {f.name: f for f in REQUEST_FIELDS}
BY_ATTR = {f.attr: f for f in REQUEST_FIELDS}
# The request parameters (everything but the images).
PARAMS = tuple(f for f in REQUEST_FIELDS if f.kind is not bytes)
OPENAI_EXTRAS = tuple(f for f in REQUEST_FIELDS if f.openai)
# What a tensor of each integer type can hold (the server checks the field's own limits and says them).
INT_RANGE = {"INT64": (-2 ** 63, 2 ** 63 - 1), "INT32": (-2 ** 31, 2 ** 31 - 1)}


class FieldError(ValueError):
    """A value outside its field's rules; ``field`` is the Triton input's name."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check(f: RequestField, value, settings):
    """``value`` converted to the field's kind and checked against its limits (None: the default)."""
    if value is None:
        return f.default_for(settings)
    lo, hi = f.limits(settings)
    if f.kind is str:
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise FieldError("is not valid UTF-8 text", f.name) from None
        value = str(value)
        if hi is not None and len(value) > hi:
            raise FieldError(f"has {len(value)} characters, above the limit of {hi}", f.name)
        if f.choices:
            if value.lower() not in f.choices:
                raise FieldError(f"must be one of {', '.join(f.choices)}, got {value[:40]!r}", f.name)
            value = value.lower()
        return value
    if f.kind is bool:
        return bool(value)
    try:
        value = f.kind(value)
    except (TypeError, ValueError, OverflowError):
        raise FieldError(f"must be a number, got {value!r:.40}", f.name) from None
    if (f.kind is float and not math.isfinite(value)) or (lo is not None and value < lo) or \
            (hi is not None and value > hi):
        raise FieldError(f"must be between {lo} and {hi}{f.unit}, got {value}", f.name)
    return value
