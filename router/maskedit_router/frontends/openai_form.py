"""OpenAI's ``POST /v1/images/edits`` form, read into the ``edit`` ensemble's inputs.

Plain functions over the form's fields (name -> bytes for files, str for text), so the rules unit-test without a
server. Bad input raises ``ApiError`` naming the form field, in OpenAI's error shape.

Mask rule: OpenAI marks the area to edit by the *transparent* pixels of the mask (alpha); maskedit's own masks
are white = edit. A mask with an alpha channel in which some pixel is not fully opaque is read the OpenAI way
(alpha < 128 edits) and sent on as a white-is-edit grayscale PNG; any other mask (no alpha, or fully opaque) is
sent unchanged and read the maskedit way (grayscale >= 128 edits). Without a mask, the image's own transparent
pixels are the edit area (as OpenAI does); an image without any is an error naming ``mask``.
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from maskedit_common.controls import ControlSpecError
from maskedit_common.controls import parse as parse_controls
from maskedit_common.loras import LoraSpecError
from maskedit_common.loras import parse as parse_loras
from maskedit_common.request_fields import INT_RANGE, OPENAI_EXTRAS
from maskedit_common.settings import Settings

MAX_N = 10  # OpenAI's own limit for n
MAX_SIDE = math.isqrt(Settings.max_input_pixels)  # the side of the server's default input limit (4096)
# Accepted for compatibility and not used: they do not change what an inpainting model computes here.
IGNORED = {"quality", "input_fidelity", "safety_identifier", "user"}
# Only the tensors' own ranges are checked here: the server checks the limits (and says them) as for any client.
INT_EXTRAS = {f.attr: INT_RANGE[f.dtype] for f in OPENAI_EXTRAS if f.kind is int}
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 503: "server_error", 504: "timeout_error", 401: "authentication_error",
             403: "permission_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param, code)


@dataclass
class EditJob:
    """One ``/v1/images/edits`` call: ``n`` edits of one template with seeds ``seed``, ``seed + 1``, ..."""

    image: bytes
    mask: bytes  # white = edit (maskedit's convention), encoded
    prompt: str
    negative_prompt: str | None = None  # SD 2 / SDXL backends (a Flux backend refuses it by name)
    n: int = 1
    size: tuple[int, int] | None = None  # (w, h) to resize the result to; None: the template's own size
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    template_seed: int | None = None
    deadline_ms: int | None = None
    use_cache: bool | None = None
    temporal: str | None = None  # temporal reuse: TEMPORAL's JSON text (``maskedit_common.temporal``)
    lora: tuple = ()  # LoRA adapters: ``maskedit_common.loras.LoraRef`` (name, scale), sent as LORAS
    controls: tuple = ()  # ControlNets: ``maskedit_common.controls.ControlSpec``, sent as CONTROLS
    control_images: list = field(default_factory=list)  # one encoded image (or base64) per control: CONTROL_IMAGES
    # ``image[]``'s images after the first (the template): an in-context edit model's reference images, sent as
    # REFERENCE_IMAGES (FLUX.2 [klein] takes several, FLUX.1 Kontext one; others refuse them by name)
    reference_images: list = field(default_factory=list)
    # the stock inpainting pipelines' own parameters (docs/api.md) and the result's encoding
    strength: float | None = None
    padding_mask_crop: int | None = None
    guidance_rescale: float | None = None
    true_cfg_scale: float | None = None
    output_format: str | None = None  # png, jpeg, webp (OpenAI's own field)
    output_quality: int | None = None  # jpeg / webp; OpenAI's ``output_compression`` (0-100) sets it too
    model: str | None = None
    user: str | None = None
    ignored: list = field(default_factory=list)

    def seeds(self) -> list[int | None]:
        """Each of the n edits' seed: consecutive from ``seed`` (0 by default, the server's default)."""
        base = self.seed or 0
        return [self.seed if self.n == 1 else base + i for i in range(self.n)]


def _text(form: dict, name: str) -> str | None:
    v = form.get(name)
    if v is None:
        return None
    if isinstance(v, list):
        raise bad(name, f"is given {len(v)} times; send it once")
    if isinstance(v, bytes):
        try:
            v = v.decode("utf-8")
        except UnicodeDecodeError:
            raise bad(name, "is not UTF-8 text") from None
    return v


def _int(form: dict, name: str, lo: int, hi: int) -> int | None:
    v = _text(form, name)
    if v is None or v == "":
        return None
    try:
        x = int(v)
    except ValueError:
        raise bad(name, f"must be an integer, got {v[:40]!r}") from None
    if not lo <= x <= hi:
        raise bad(name, f"must be between {lo} and {hi}, got {x}")
    return x


def _float(form: dict, name: str) -> float | None:
    v = _text(form, name)
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        raise bad(name, f"must be a number, got {v[:40]!r}") from None


def _bool(form: dict, name: str) -> bool | None:
    v = _text(form, name)
    if v is None or v == "":
        return None
    if v.lower() in ("true", "1"):
        return True
    if v.lower() in ("false", "0"):
        return False
    raise bad(name, f"must be true or false, got {v[:40]!r}")


def _images(form: dict) -> list[bytes]:
    """``image`` / ``image[]``: the template, then any reference images (the server checks how many it takes)."""
    for name in ("image", "image[]"):
        v = form.get(name)
        if v is not None:
            return [x if isinstance(x, bytes) else x.encode() for x in (v if isinstance(v, list) else [v])]
    return []


def _file(form: dict, *names: str) -> bytes | None:
    for name in names:
        v = form.get(name)
        if isinstance(v, list):  # mask[]: one mask
            if len(v) != 1:
                raise bad(name.removesuffix("[]"), f"one file is supported, got {len(v)}")
            v = v[0]
        if v is not None:
            return v if isinstance(v, bytes) else v.encode()
    return None


def _open(data: bytes) -> Image.Image | None:
    """The decoded image, or None if it is not one (the server then rejects it with its own message)."""
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > MAX_SIDE * MAX_SIDE:
            return None  # the server rejects it from its header, with the limit in the message
        img.load()
        return img
    except Exception:  # Pillow raises many types for bad data
        return None


def _alpha(img: Image.Image) -> np.ndarray | None:
    """The alpha channel, if the image has one and some pixel is not fully opaque."""
    if img.mode not in ("RGBA", "LA", "PA") and "transparency" not in img.info:
        return None
    a = np.asarray(img.convert("RGBA"))[..., 3]
    return a if (a < 255).any() else None


def _png(white_is_edit: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(white_is_edit.astype(np.uint8) * 255).save(buf, format="PNG")
    return buf.getvalue()


def edit_mask(mask: bytes | None, image: bytes) -> bytes:
    """The white-is-edit mask to send, by the rule in this module's docstring."""
    if mask is not None:
        img = _open(mask)
        alpha = _alpha(img) if img is not None else None
        return mask if alpha is None else _png(alpha < 128)
    img = _open(image)
    alpha = _alpha(img) if img is not None else None
    if alpha is None:
        raise bad("mask", "is required unless the image has transparent pixels marking the area to edit",
                  "missing_required_parameter")
    return _png(alpha < 128)


def parse_size(value: str | None, image: bytes) -> tuple[int, int] | None:
    if value in (None, "", "auto"):
        return None
    m = _SIZE.match(value)
    if not m:
        raise bad("size", f"must be WIDTHxHEIGHT (e.g. 512x512) or auto, got {value[:40]!r}")
    w, h = int(m.group(1)), int(m.group(2))
    if not (16 <= w <= MAX_SIDE and 16 <= h <= MAX_SIDE):
        raise bad("size", f"sides must be between 16 and {MAX_SIDE} pixels, got {w}x{h}")
    img = _open(image)
    if img is not None and abs(w / h - img.width / img.height) > 0.01 * img.width / img.height:
        raise bad("size", f"{w}x{h} does not keep the image's aspect ratio ({img.width}x{img.height}); the "
                          "edit keeps the template outside the mask, so the result cannot be reshaped")
    return None if img is not None and (w, h) == img.size else (w, h)


def _extra(form: dict, f):
    """A schema field sent as a form field, read by its kind (limits are the server's to check and say)."""
    if f.kind is int:
        return _int(form, f.attr, *INT_RANGE[f.dtype])
    if f.kind is float:
        return _float(form, f.attr)
    if f.kind is bool:
        return _bool(form, f.attr)
    return _text(form, f.attr) or None


def parse(form: dict, models: list[str]) -> EditJob:
    """An ``EditJob`` from the form's fields, or ``ApiError`` naming the field at fault."""
    form = fold_nested(form)
    unknown = sorted(set(form) - KNOWN)
    if unknown:
        raise bad(unknown[0], "is not a parameter of this endpoint (see docs/openai.md)", "unknown_parameter")
    images = _images(form)
    image = images[0] if images else None
    if not image:
        raise bad("image", "is required: the image (PNG, JPEG or WebP) to edit", "missing_required_parameter")
    prompt = _text(form, "prompt")
    if prompt is None:
        raise bad("prompt", "is required", "missing_required_parameter")
    model = _text(form, "model")
    if model and model not in models:
        raise ApiError(404, f"model: {model!r} does not exist; this server has {', '.join(models)}", "model",
                       "model_not_found")
    fmt = _text(form, "response_format")
    if fmt not in (None, "", "b64_json"):
        raise bad("response_format", f"only b64_json is supported (this server keeps no images to link to), "
                                     f"got {fmt[:40]!r}")
    if _text(form, "output_compression") not in (None, "") and _text(form, "output_quality") not in (None, ""):
        raise bad("output_compression", "was sent besides output_quality; send one of them")
    if _bool(form, "stream"):
        raise bad("stream", "streaming is not supported by this endpoint")
    background = _text(form, "background")
    if background not in (None, "", "auto", "opaque"):
        raise bad("background", f"only auto or opaque is supported, got {background[:40]!r}")
    job = EditJob(
        image=image, mask=edit_mask(_file(form, "mask"), image), prompt=prompt,
        n=_int(form, "n", 1, MAX_N) or 1, size=parse_size(_text(form, "size"), image),
        model=model or None, user=_text(form, "user"), ignored=sorted(k for k in form if k in IGNORED - {"user"}),
        **{f.attr: _extra(form, f) for f in OPENAI_EXTRAS})
    if job.output_quality is None:  # OpenAI's name: its 0-100 level is the encoder's quality (100: the least loss)
        compression = _int(form, "output_compression", 0, 100)
        job.output_quality = None if compression is None else max(1, compression)
    lora = form.get("lora") if isinstance(form.get("lora"), (dict, list)) else _text(form, "lora")
    if lora:
        try:  # an object or a list of {"name", "scale"} (vLLM-Omni's shape); the server checks its own limits
            job.lora = parse_loras(lora, max_loras=64, max_scale=float("inf"))
        except LoraSpecError as e:
            raise bad("lora", str(e)) from None
    job.controls, job.control_images = _controls(form)
    job.reference_images = images[1:]
    if job.seed is not None and job.seed + job.n - 1 > INT_EXTRAS["seed"][1]:
        raise bad("seed", f"seed + n - 1 must be at most {INT_EXTRAS['seed'][1]}")
    return job


def _controls(form: dict) -> tuple[tuple, list]:
    """``controls``: the CONTROLS JSON (docs/controlnet.md), whose objects may carry their control image as base64
    in ``"image"`` (what the OpenAI SDK's ``extra_body`` can send); else the images are ``control_image`` file parts
    (``control_image[]`` repeated), in order. The server checks names, limits and the images."""
    text = form.get("controls")
    text = text if isinstance(text, (dict, list)) else _text(form, "controls")
    files = form.get("control_image[]", form.get("control_image"))
    files = [] if files is None else files if isinstance(files, list) else [files]
    images = [f if isinstance(f, bytes) else f.encode() for f in files]
    if not text:
        if images:
            raise bad("control_image", "was sent without controls naming a ControlNet for it")
        return (), []
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise bad("controls", f"is not valid JSON ({e.msg} at character {e.pos})") from None
    items = [value] if isinstance(value, dict) else value
    if isinstance(items, list) and any(isinstance(it, dict) and "image" in it for it in items):
        if images:
            raise bad("control_image", "was sent besides images inside controls; send the images one way")
        images = [_image_text(it.pop("image", "")) if isinstance(it, dict) else b"" for it in items]
    try:
        specs = parse_controls(items, max_controls=64, max_scale=float("inf"))
    except ControlSpecError as e:
        raise bad("controls", str(e)) from None
    return specs, images


def _image_text(v) -> bytes:
    """A control image inside ``controls``: base64 text (JSON, or a form field), or a file part's own bytes."""
    return v if isinstance(v, bytes) else str(v).encode()


# -- extra_body's nested values as form fields ------------------------------------------------------------------
# The openai package sends ``extra_body`` inside a multipart form as bracketed fields (its ``_qs`` "brackets"
# format): ``{"lora": {"name": "a", "scale": 0.8}}`` as ``lora[name]``, ``lora[scale]``; a list of objects as
# ``controls[][name]`` repeated (one value per object, grouped by key); a list of names as ``lora[]``; a list inside
# an object as ``temporal[steps][]``. Other form clients number the entries: ``controls[0][name]``. These fold back
# into the value the JSON text would carry.
NESTED = ("lora", "controls", "temporal")
JSON_TEXT = ("temporal",)  # sent on as JSON text (the TEMPORAL tensor's form); the others are parsed here
TEXT_KEYS = {"name", "policy", "mode", "preprocess", "image"}  # strings in the JSON shape; other leaves are numbers
_BRACKETED = re.compile(r"^([A-Za-z_]+)((?:\[[^\[\]]*\])+)$")
_KEY = re.compile(r"\[([^\[\]]*)\]")
_SHAPES = {("k",): "object", ("k", "[]"): "object", ("[]",): "names", ("i",): "names", ("[]", "k"): "columns",
           ("i", "k"): "numbered"}


def fold_nested(form: dict) -> dict:
    """``form`` with each nested field's bracketed parts folded into one value (a dict, or a list of dicts or
    names) under the field's name; other fields unchanged. Errors name the field."""
    parts: dict[str, list] = {}
    out = {}
    for key, value in form.items():
        m = _BRACKETED.match(key)
        if m and m.group(1) in NESTED:
            parts.setdefault(m.group(1), []).append((_KEY.findall(m.group(2)), key, value))
        else:
            out[key] = value
    for name, items in parts.items():
        if name in out:
            raise bad(name, f"was sent both as {name} and as {items[0][1]}; send it one way")
        out[name] = _fold(name, items)
        if name in JSON_TEXT:
            out[name] = json.dumps(out[name])
    return out


def _leaf(key: str, value):
    """A form value as the JSON shape has it: text under ``TEXT_KEYS``, else the number (or true / false) it spells;
    what spells neither stays text, for the field's parser to name."""
    if not isinstance(value, str) or key in TEXT_KEYS:
        return value
    try:
        v = json.loads(value)
    except ValueError:
        return value
    return v if isinstance(v, (int, float, bool)) else value


def _one(name: str, field: str, value):
    if isinstance(value, list):
        raise bad(name, f"{field} is given {len(value)} times; send it once")
    return value


def _fold(name: str, items: list):
    shapes = {tuple("i" if k.isdigit() else "[]" if k == "" else "k" for k in path) for path, _, _ in items}
    kinds = {_SHAPES.get(shape) for shape in shapes}
    if len(kinds) != 1 or None in kinds or (len(shapes) > 1 and kinds != {"object"}):
        raise bad(name, f"form fields {', '.join(sorted(k for _, k, _ in items))} mix shapes or nest too deep: "
                        f"send {name}[key], {name}[][key] or {name}[0][key] fields, or {name} as JSON text")
    kind = kinds.pop()
    if kind == "object":  # one object (a list under a key: ``temporal[steps][]``)
        return {path[0]: [_leaf(path[0], v) for v in (value if isinstance(value, list) else [value])]
                if len(path) == 2 else _leaf(path[0], _one(name, field, value)) for path, field, value in items}
    if kind == "names":  # a list of names, ``lora[]`` or numbered
        if len(items) == 1 and items[0][0] == [""]:
            return items[0][2] if isinstance(items[0][2], list) else [items[0][2]]
        return [v for _, v in sorted((int(path[0]), _one(name, field, value)) for path, field, value in items)]
    if kind == "numbered":  # numbered objects
        objs: dict[int, dict] = {}
        for (i, key), field, value in items:
            objs.setdefault(int(i), {})[key] = _leaf(key, _one(name, field, value))
        return [objs[i] for i in sorted(objs)]
    # columns: a list of objects, each key's values in object order; only equal counts say which is whose
    columns = {path[1]: value if isinstance(value, list) else [value] for path, _, value in items}
    n = max(len(v) for v in columns.values())
    uneven = sorted(k for k, v in columns.items() if len(v) != n)
    if uneven:
        raise bad(name, f"{name}[][{uneven[0]}] has {len(columns[uneven[0]])} values for {n} entries: give every "
                        f"object of the list the same keys, or send {name} as JSON text")
    return [{k: _leaf(k, v[i]) for k, v in columns.items()} for i in range(n)]


KNOWN = {"image", "image[]", "mask", "prompt", "model", "n", "size", "response_format", "output_format", "output_compression", "stream",
         "background", "lora", "controls", "control_image", "control_image[]"} | IGNORED | {
    f.attr for f in OPENAI_EXTRAS}
# Server-side names of the ensemble's inputs -> the form field a client sets (errors name the latter).
PARAM_OF_TENSOR = {"TEMPLATE": "image", "MASK": "mask", "PROMPT": "prompt", "LORAS": "lora", "CONTROLS": "controls",
                   "CONTROL_IMAGES": "control_image", "REFERENCE_IMAGES": "image",
                   **{f.name: f.attr for f in OPENAI_EXTRAS}}
