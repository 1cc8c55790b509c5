"""What the router reads from an edit request without running the model: template identity, mask ratio, steps."""

from __future__ import annotations

import io
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from maskedit_common.mask_pixels import DEFAULT_THRESHOLD

TOKEN_PX = 16  # Flux: one image token per 16x16 pixels
# Cells up to this side: the rounded mean of a 0/255 cell is > 0 iff one pixel is 255 (255 / 22² >= 0.5), so a box
# average at whole cells (Image.reduce) and BOX resize agree exactly: any edited pixel marks its token
ANY_CELL_MAX = 22


@dataclass(frozen=True)
class EditFeatures:
    template_key: str | None  # hash of the template bytes and the settings that key the activation cache
    mask_ratio: float  # fraction of image tokens the mask touches
    tokens: int
    steps: int | None
    # what the simulator replays from a trace (the served ensemble has one base model: None), and the request's
    # own deadline (``DEADLINE_MS``) in seconds from its arrival, when it has one
    model: str | None = None  # the base checkpoint it needs
    loras: int = 0  # LoRA adapters applied on it
    deadline_s: float | None = None
    adapters: tuple[str, ...] = ()  # their names (``LORAS``), when known: the router tracks where each was served
    # its temporal reuse (``TEMPORAL``: a ``maskedit_common.temporal.TemporalSpec``), None when it sends none (the
    # backends' default applies)
    temporal: object = None
    strength: float = 1.0  # STRENGTH: it runs about strength x steps of the schedule

    @property
    def run_steps(self) -> int | None:
        """Steps it runs: ~strength x steps (the pipelines round it a step either way)."""
        return None if self.steps is None else max(1, int(round(self.steps * self.strength)))

    @property
    def runs_edit(self) -> bool:
        """An edit (its tokens are the model's grid), not a call that runs none (those have 0 tokens)."""
        return self.tokens > 0


def _tensor_bytes(request, index: int, raw: bool, view: bool = False) -> bytes | memoryview | None:
    """The first element of a BYTES input; ``view``: a raw input's as a view into the message's bytes, not a copy
    (a template is ~0.4 MB at 512², read for its hash only)."""
    if raw:
        blob = request.raw_input_contents[index]
        if len(blob) < 4:
            return None
        (n,) = struct.unpack_from("<I", blob)  # BYTES tensors: 4-byte length, then the bytes
        return memoryview(blob)[4:4 + n] if view else blob[4:4 + n]
    contents = request.inputs[index].contents.bytes_contents
    return contents[0] if contents else None


def _scalar(request, index: int, raw: bool, dtype) -> float | None:
    if raw:
        a = np.frombuffer(request.raw_input_contents[index], dtype=dtype)
        return a[0].item() if a.size else None
    c = request.inputs[index].contents
    for field in ("int_contents", "int64_contents", "fp32_contents", "fp64_contents", "bool_contents"):
        vals = getattr(c, field)
        if len(vals):
            return vals[0]
    return None


def grid_tokens(resolution: int) -> int:
    """Image tokens of a square image at the model's working ``resolution`` (what a full edit computes)."""
    return (resolution // TOKEN_PX) ** 2


def crop_box(binary: np.ndarray, pad: int) -> tuple[int, int, int, int] | None:
    """PADDING_MASK_CROP's crop (x1, y1, x2, y2) of a mask (True = edit): its bounding box ``pad`` pixels wider, then
    widened to the image's aspect ratio, as the stock pipelines' ``get_crop_region`` (whose model size keeps that
    aspect here). None for an empty mask (nothing to crop around)."""
    ys, xs = np.nonzero(binary)
    if ys.size == 0:
        return None
    h, w = binary.shape
    x1, y1 = max(int(xs.min()) - pad, 0), max(int(ys.min()) - pad, 0)
    x2, y2 = min(int(xs.max()) + 1 + pad, w), min(int(ys.max()) + 1 + pad, h)
    if (x2 - x1) / (y2 - y1) > w / h:  # too wide for the image's aspect: taller, centred, kept inside it
        y1, y2 = _widen(y1, y2, int((x2 - x1) * h / w), h)
    else:
        x1, x2 = _widen(x1, x2, int((y2 - y1) * w / h), w)
    return x1, y1, x2, y2


def _widen(lo: int, hi: int, want: int, limit: int) -> tuple[int, int]:
    grow = max(0, want - (hi - lo))
    lo, hi = lo - grow // 2, hi + grow - grow // 2
    if hi > limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, min(limit, hi - lo)
    return lo, hi


def mask_tokens(mask: bytes, resolution: int = 1024, pad: int | None = None,
                threshold: int = DEFAULT_THRESHOLD) -> np.ndarray:
    """Edited tokens of an encoded mask (the backend's rule, ``maskedit_common.mask_pixels``: gray ``threshold``
    or above, never a transparent pixel) on a grid like the model's, flattened row-major as the model orders image
    tokens: a token counts if any pixel of its cell is edited. ``pad`` (PADDING_MASK_CROP): the grid is the crop's,
    which the model edits at its full size."""
    from PIL import Image

    from maskedit_common.mask_pixels import edited
    from maskedit_common.wire import maybe_base64

    raw, _ = maybe_base64(mask)
    binary = edited(Image.open(io.BytesIO(raw)), threshold)  # by the backend's rule
    box = crop_box(binary, pad) if pad is not None else None
    if box is not None:
        x1, y1, x2, y2 = box
        binary = binary[y1:y2, x1:x2]
    h, w = binary.shape
    scale = (resolution * resolution / (w * h)) ** 0.5
    gw, gh = max(1, round(w * scale / TOKEN_PX)), max(1, round(h * scale / TOKEN_PX))
    layer = Image.fromarray(binary.view(np.uint8) * 255)
    k = w // gw
    if k * gw == w and k * gh == h and k <= ANY_CELL_MAX:  # whole square cells: reduce is BOX's answer, 2-3x faster
        return np.asarray(layer.reduce(k)).reshape(-1) > 0
    return np.asarray(layer.resize((gw, gh), Image.BOX)).reshape(-1) > 0


def mask_ratio(mask: bytes, resolution: int = 1024, pad: int | None = None,
               threshold: int = DEFAULT_THRESHOLD) -> tuple[float, int]:
    """(fraction of image tokens the mask touches, image tokens) on the grid of ``mask_tokens``."""
    t = mask_tokens(mask, resolution, pad, threshold)
    return float(t.mean()), int(t.size)


class MaskRatios:
    """``mask_ratio`` remembered by the mask's bytes (xxh3-128 of them, with the grid's settings), least recently
    used out: edits of one template tend to send its mask again (the face or garment region), and decoding it is
    most of what reading a request costs the router (the grid 0.82 of 1.05 ms for a 512² PNG; hashing it, ~1 us). A
    colliding digest would only misprice one request, not misroute its bytes. ``threshold``: the gray level the
    backends edit from (``MASKEDIT_MASK_THRESHOLD``; the router's ``build`` sets it from the same settings)."""

    def __init__(self, size: int = 16384, threshold: int = DEFAULT_THRESHOLD):
        self.size = size
        self.threshold = threshold
        self._got: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # the router's worker threads read requests concurrently
        self.hits = self.misses = 0

    def __call__(self, mask: bytes, resolution: int, pad: int | None) -> tuple[float, int]:
        threshold = self.threshold
        key = (xxhash.xxh3_128_digest(mask), resolution, pad, threshold)
        with self._lock:
            got = self._got.get(key)
            if got is not None:
                self._got.move_to_end(key)
                self.hits += 1
                return got
            self.misses += 1
        got = mask_ratio(mask, resolution, pad, threshold)  # unreadable: raises, and nothing is remembered
        with self._lock:
            self._got[key] = got
            while len(self._got) > self.size:
                self._got.popitem(last=False)
        return got

    def collect(self):
        """Prometheus (a collector on the router's registry): lookups by result since the process started."""
        from prometheus_client.core import CounterMetricFamily

        m = CounterMetricFamily("maskedit_router_mask_ratio_lookups", "requests whose mask ratio was remembered "
                                "(hit: no decode) or measured (miss: decoded), by result", labels=["result"])
        m.add_metric(["hit"], self.hits)
        m.add_metric(["miss"], self.misses)
        yield m


MASK_RATIOS = MaskRatios()


def extract(request, resolution: int = 1024) -> EditFeatures:
    """Features of a ``ModelInferRequest`` for the ``edit`` ensemble (None/defaults where absent), with the mask
    measured on the token grid of a model working at ``resolution``."""
    raw = len(request.raw_input_contents) == len(request.inputs) and len(request.inputs) > 0
    names = {t.name: i for i, t in enumerate(request.inputs)}
    template = _tensor_bytes(request, names["TEMPLATE"], raw, view=True) if "TEMPLATE" in names else None
    steps = _scalar(request, names["STEPS"], raw, np.int32) if "STEPS" in names else None
    strength, pad = 1.0, None
    try:  # malformed: the backend will say so; costed as a whole edit meanwhile
        if "STRENGTH" in names:
            got = _scalar(request, names["STRENGTH"], raw, np.float64)
            strength = min(1.0, max(0.0, float(got))) if got is not None and np.isfinite(got) else 1.0
        if "PADDING_MASK_CROP" in names:
            pad = _scalar(request, names["PADDING_MASK_CROP"], raw, np.int32)
            pad = None if pad is None or pad < 0 else int(pad)
    except Exception:
        strength, pad = 1.0, None
    extra = b""
    for name, dt in (("STEPS", np.int32), ("GUIDANCE", np.float32), ("TEMPLATE_SEED", np.int64),
                     ("PADDING_MASK_CROP", np.int32)):
        if name in names:
            extra += f"{name}={_scalar(request, names[name], raw, dt)};".encode()
    ratio, tokens = 1.0, grid_tokens(resolution)
    if "MASK" in names:
        mask = _tensor_bytes(request, names["MASK"], raw) or b""
        try:
            ratio, tokens = MASK_RATIOS(mask, resolution, pad)
            if pad is not None:  # a cropped edit's entry is its crop's (the backend keys it on the crop)
                extra += xxhash.xxh3_64_digest(mask)
        except Exception:
            ratio = 1.0  # unreadable: the backend will reject it; cost it as a full edit
    key = None
    if template:  # the hash of template + extra, fed in turn (no concatenated copy); xxh3: 0.05 ms to SHA-1's 0.32, and
        h = xxhash.xxh3_128(template)  # the key only groups requests by cache entry inside the router
        h.update(extra)
        key = h.hexdigest()[:20]
    names = adapter_names(request)
    return EditFeatures(key, ratio, tokens, int(steps) if steps is not None else None,
                        deadline_s=deadline_s(request), loras=len(names), adapters=names,
                        temporal=temporal_spec(request, steps), strength=strength)


def routing_features(request, resolution: int) -> EditFeatures:
    """``extract`` as the router prices any call: a call to another model than ``edit`` is no edit work; an edit
    whose inputs cannot be read is priced as a full-image template run (its backend answers the error)."""
    if request.model_name != "edit":
        return EditFeatures(None, 0.0, 0, None)
    try:
        return extract(request, resolution)
    except Exception:
        return EditFeatures(None, 1.0, grid_tokens(resolution), None)


def temporal_spec(request, steps):
    """The request's ``TEMPORAL`` policy (None when absent or malformed: the backend refuses those)."""
    from maskedit_common.temporal import parse

    names, raw = _names(request)
    if "TEMPORAL" not in names:
        return None
    try:  # a step list is checked against the request's steps by the backend
        spec = parse(_tensor_bytes(request, names["TEMPORAL"], raw), int(steps) if steps else 10 ** 6)
    except (ValueError, IndexError):
        return None
    return spec if spec.on else None


def edit_info(response) -> dict | None:
    """The ``EDIT_INFO`` JSON of an ``edit`` response (``ModelInferResponse``), None when it has none."""
    import json

    for i, out in enumerate(response.outputs):
        if out.name != "EDIT_INFO":
            continue
        if i < len(response.raw_output_contents):
            blob = response.raw_output_contents[i]
            data = blob[4:4 + struct.unpack("<I", blob[:4])[0]] if len(blob) >= 4 else b""
        else:
            data = out.contents.bytes_contents[0] if out.contents.bytes_contents else b""
        try:
            return json.loads(data)
        except ValueError:
            return None
    return None


def adapter_names(request) -> tuple[str, ...]:
    """The names of the request's ``LORAS`` adapters (none when absent or malformed: the backend refuses those)."""
    from maskedit_common.loras import LoraSpecError, parse

    names, raw = _names(request)
    if "LORAS" not in names:
        return ()
    try:
        refs = parse(_tensor_bytes(request, names["LORAS"], raw), max_loras=64, max_scale=float("inf"))
    except (LoraSpecError, IndexError):
        return ()
    return tuple(r.name for r in refs)


def _names(request) -> tuple[dict, bool]:
    raw = len(request.raw_input_contents) == len(request.inputs) and len(request.inputs) > 0
    return {t.name: i for i, t in enumerate(request.inputs)}, raw


def deadline_s(request) -> float | None:
    """The request's own deadline (``DEADLINE_MS``, from its arrival) in seconds, None if it has none."""
    names, raw = _names(request)
    if "DEADLINE_MS" not in names:
        return None
    try:
        ms = _scalar(request, names["DEADLINE_MS"], raw, np.int64)
    except Exception:  # malformed: the backend will say so
        return None
    return None if ms is None else ms / 1000.0


def set_deadline_ms(request, ms: int) -> None:
    """Rewrite ``DEADLINE_MS`` (a retry: what is left of it when it is sent again)."""
    names, raw = _names(request)
    if "DEADLINE_MS" not in names:
        return
    i = names["DEADLINE_MS"]
    if raw:
        request.raw_input_contents[i] = np.array([ms], np.int64).tobytes()
    else:
        c = request.inputs[i].contents
        del c.int64_contents[:]
        c.int64_contents.append(ms)
