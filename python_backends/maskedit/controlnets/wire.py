"""The ``controlnet`` Triton model's tensors: one call is one request's ControlNets at one step, and its answer is
their summed residuals. Pure functions (numpy / torch, no Triton), so the packing round trip is unit-tested.

Request (all FP32 unless said): ``CONTROLNETS`` BYTES (k,) library names; ``SCALES`` FP64 (k,) conditioning scales at
this step; ``MODES`` BYTES (k,) union mode names ("" for a plain ControlNet); ``CONTROL_IMAGES`` (k, ...) the
prepared control images (``ModelFamily.prepare_control_image``, one model size per request); and the family's
ControlNet call arguments for the request's rows: ``SAMPLE`` (R, 4, h, w), ``TIMESTEP`` (R,),
``ENCODER_HIDDEN_STATES`` (R, L, D), and for SDXL ``TEXT_EMBEDS`` (R, P) and ``TIME_IDS`` (R, T) (absent for SD 2).

Response: one packed tensor ``RESIDUALS`` (n,) FP32, the down residuals then the mid residual flattened and
concatenated, with ``RESIDUAL_SHAPES`` INT64 (count, 4) their shapes (and ``COMPUTE_S`` FP64 (1,), the model's own
time, so the caller can tell the BLS overhead from the work) — one tensor whatever the UNet's depth, so the
config does not depend on the model. Tensors travel as float32 (Triton's numpy path has no bfloat16); the receiver
casts them back to its dtype.
"""

from __future__ import annotations

import numpy as np
import torch

INPUTS = ("CONTROLNETS", "SCALES", "MODES", "CONTROL_IMAGES", "SAMPLE", "TIMESTEP", "ENCODER_HIDDEN_STATES",
          "TEXT_EMBEDS", "TIME_IDS")
OUTPUTS = ("RESIDUALS", "RESIDUAL_SHAPES", "COMPUTE_S")
_ADDED = {"TEXT_EMBEDS": "text_embeds", "TIME_IDS": "time_ids"}  # SDXL's added_cond_kwargs


def _np(t) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def pack_request(controls: list[tuple], inputs: dict) -> dict[str, np.ndarray]:
    """``controls``: (name, scale, mode or None, prepared image tensor) per active control of one request;
    ``inputs``: the family's ControlNet call arguments for its rows (``sample``, ``timestep``,
    ``encoder_hidden_states``, ``added_cond_kwargs``)."""
    out = {
        "CONTROLNETS": np.array([c[0].encode() for c in controls], dtype=np.object_),
        "SCALES": np.array([c[1] for c in controls], np.float64),
        "MODES": np.array([(c[2] or "").encode() for c in controls], dtype=np.object_),
        "CONTROL_IMAGES": np.stack([_np(c[3]) for c in controls]),
        "SAMPLE": _np(inputs["sample"]),
        "TIMESTEP": _np(inputs["timestep"]).reshape(-1),
        "ENCODER_HIDDEN_STATES": _np(inputs["encoder_hidden_states"]),
    }
    for name, key in _ADDED.items():
        if inputs.get("added_cond_kwargs"):
            out[name] = _np(inputs["added_cond_kwargs"][key])
    return out


def unpack_request(arrays: dict[str, np.ndarray], device, dtype) -> tuple[list[tuple], dict]:
    """The inverse of ``pack_request``: (name, scale, mode or None, image tensor) per control, and the inputs
    dict on ``device`` / ``dtype``."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, dtype)  # noqa: E731
    text = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
    names = [text(v) for v in arrays["CONTROLNETS"].reshape(-1)]
    modes = [text(v) or None for v in arrays["MODES"].reshape(-1)]
    scales = [float(v) for v in arrays["SCALES"].reshape(-1)]
    images = arrays["CONTROL_IMAGES"]
    if not (len(names) == len(modes) == len(scales) == len(images)):
        raise ValueError(f"CONTROLNETS, MODES, SCALES and CONTROL_IMAGES differ in length ({len(names)}, "
                         f"{len(modes)}, {len(scales)}, {len(images)})")
    controls = [(n, s, m, t(img)) for n, s, m, img in zip(names, scales, modes, images)]
    added = {key: t(arrays[name]) for name, key in _ADDED.items() if arrays.get(name) is not None}
    inputs = {"sample": t(arrays["SAMPLE"]), "timestep": t(arrays["TIMESTEP"]),
              "encoder_hidden_states": t(arrays["ENCODER_HIDDEN_STATES"]), "added_cond_kwargs": added or None}
    return controls, inputs


def pack_residuals(residuals: list) -> dict[str, np.ndarray]:
    """Down residuals then the mid residual as one flat FP32 tensor and their shapes."""
    flat = [_np(r).reshape(-1) for r in residuals]
    shapes = np.array([list(r.shape) for r in residuals], np.int64)
    return {"RESIDUALS": np.concatenate(flat) if flat else np.zeros(0, np.float32), "RESIDUAL_SHAPES": shapes}


def unpack_residuals(arrays: dict[str, np.ndarray], device, dtype) -> list[torch.Tensor]:
    """The inverse of ``pack_residuals``: the residual tensors on ``device`` / ``dtype``."""
    flat, shapes = arrays["RESIDUALS"].reshape(-1), arrays["RESIDUAL_SHAPES"]
    sizes = [int(np.prod(s)) for s in shapes]
    if sum(sizes) != flat.size:
        raise ValueError(f"RESIDUALS holds {flat.size} numbers but RESIDUAL_SHAPES describes {sum(sizes)}")
    out, at = [], 0
    for shape, n in zip(shapes, sizes):
        out.append(torch.from_numpy(np.ascontiguousarray(flat[at:at + n])).reshape(tuple(int(d) for d in shape))
                   .to(device, dtype))
        at += n
    return out
