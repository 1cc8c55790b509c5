"""The ``controlnet`` Triton model's tensors: one call is one request's ControlNets at one step, and its answer is
their summed residuals. Pure functions (numpy / torch, no Triton), so the packing round trip is unit-tested.

Request (all FP32 unless said): ``CONTROLNETS`` BYTES (k,) library names; ``SCALES`` FP64 (k,) conditioning scales at
this step; ``MODES`` BYTES (k,) union mode names ("" for a plain ControlNet); ``CONTROL_IMAGES`` (k, ...) the
prepared control images (``ModelFamily.prepare_control_image``, one model size per request); and the family's
ControlNet call arguments for the request's rows: ``SAMPLE`` (R, 4, h, w), ``TIMESTEP`` (R,),
``ENCODER_HIDDEN_STATES`` (R, L, D), and for SDXL ``TEXT_EMBEDS`` (R, P) and ``TIME_IDS`` (R, T) (absent for SD 2).
The Flux families (``maskedit.controlnets.flux_remote``) send their ControlNets' arguments instead of ``SAMPLE`` /
``CONTROL_IMAGES``: ``LATENTS`` (R, N, C) the packed noisy latents, ``CONTROL_LATENTS`` (k, N, C) each control's packed
VAE latents, ``POOLED_PROJECTIONS`` (R, P), ``GUIDANCE`` (R,) (absent when not embedded), ``TXT_IDS`` (L, 3),
``IMG_IDS`` (N, 3) and ``STRUCTURE`` INT64 (2,): the request's merged (double, single) list lengths, -1 for none
(``controlnets.flux.structure``: it depends on all of the request's controls, acting this step or not).

Response: one packed tensor ``RESIDUALS`` (n,) FP32, the down residuals then the mid residual flattened and
concatenated, with ``RESIDUAL_SHAPES`` INT64 (count, 4) their shapes (and ``COMPUTE_S`` FP64 (1,), the model's own
time, so the caller can tell the BLS overhead from the work) — one tensor whatever the UNet's depth, so the
config does not depend on the model — and ``RESIDUAL_GROUPS`` INT64 (g,): how many of the residuals belong to each
of the family's lists (UNet: one list, down then mid; Flux: double then single block samples, -1 for an absent one). Tensors travel as float32 (Triton's numpy path has no bfloat16); the receiver
casts them back to its dtype.
"""

from __future__ import annotations

import numpy as np
import torch

INPUTS = ("CONTROLNETS", "SCALES", "MODES", "CONTROL_IMAGES", "SAMPLE", "TIMESTEP", "ENCODER_HIDDEN_STATES",
          "TEXT_EMBEDS", "TIME_IDS", "LATENTS", "CONTROL_LATENTS", "POOLED_PROJECTIONS", "GUIDANCE", "TXT_IDS",
          "IMG_IDS", "STRUCTURE")
OUTPUTS = ("RESIDUALS", "RESIDUAL_SHAPES", "COMPUTE_S", "RESIDUAL_GROUPS")
_ADDED = {"TEXT_EMBEDS": "text_embeds", "TIME_IDS": "time_ids"}  # SDXL's added_cond_kwargs
# The Flux ControlNet call's arguments (``FluxControlNetModel.forward``'s names) besides the timestep and text
_FLUX = {"LATENTS": "hidden_states", "POOLED_PROJECTIONS": "pooled_projections", "TXT_IDS": "txt_ids",
         "IMG_IDS": "img_ids"}


class Residuals(list):
    """The residual tensors of one call, and ``groups``: how many belong to each of the family's lists."""

    def __init__(self, tensors, groups=()):
        super().__init__(tensors)
        self.groups = tuple(int(g) for g in groups)


def _np(t) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def pack_request(controls: list[tuple], inputs: dict) -> dict[str, np.ndarray]:
    """``controls``: (name, scale, mode or None, prepared image tensor) per active control of one request;
    ``inputs``: the family's ControlNet call arguments for its rows (``sample``, ``timestep``,
    ``encoder_hidden_states``, ``added_cond_kwargs``; a Flux family's: ``hidden_states``, ``timestep``,
    ``guidance``, ``pooled_projections``, ``encoder_hidden_states``, ``txt_ids``, ``img_ids``, ``structure``, its
    controls' images being their packed latents)."""
    if "hidden_states" in inputs:
        return _pack_flux(controls, inputs)
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


def _names(controls) -> dict[str, np.ndarray]:
    return {"CONTROLNETS": np.array([c[0].encode() for c in controls], dtype=np.object_),
            "SCALES": np.array([c[1] for c in controls], np.float64),
            "MODES": np.array([(c[2] or "").encode() for c in controls], dtype=np.object_)}


def _pack_flux(controls: list[tuple], inputs: dict) -> dict[str, np.ndarray]:
    out = {**_names(controls), "CONTROL_LATENTS": np.stack([_np(c[3]).reshape(c[3].shape[-2:]) for c in controls]),
           "TIMESTEP": _np(inputs["timestep"]).reshape(-1), "ENCODER_HIDDEN_STATES": _np(inputs["encoder_hidden_states"]),
           "STRUCTURE": np.array([-1 if n is None else n for n in inputs["structure"]], np.int64)}
    out.update({name: _np(inputs[key]) for name, key in _FLUX.items()})
    if inputs.get("guidance") is not None:
        out["GUIDANCE"] = _np(inputs["guidance"]).reshape(-1)
    return out


def _unpack_flux(arrays, t) -> dict:
    inputs = {key: t(arrays[name]) for name, key in _FLUX.items()}
    g = arrays.get("GUIDANCE")  # float32 as the denoiser keeps it, whatever the model's dtype
    inputs.update(timestep=t(arrays["TIMESTEP"]), encoder_hidden_states=t(arrays["ENCODER_HIDDEN_STATES"]),
                  guidance=None if g is None else torch.from_numpy(np.ascontiguousarray(g, np.float32)).to(
                      inputs["hidden_states"].device),
                  structure=tuple(None if n < 0 else int(n) for n in arrays["STRUCTURE"].reshape(-1)))
    return inputs


def unpack_request(arrays: dict[str, np.ndarray], device, dtype) -> tuple[list[tuple], dict]:
    """The inverse of ``pack_request``: (name, scale, mode or None, image tensor) per control, and the inputs
    dict on ``device`` / ``dtype``."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, dtype)  # noqa: E731
    text = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
    names = [text(v) for v in arrays["CONTROLNETS"].reshape(-1)]
    modes = [text(v) or None for v in arrays["MODES"].reshape(-1)]
    scales = [float(v) for v in arrays["SCALES"].reshape(-1)]
    flux = arrays.get("LATENTS") is not None
    images = arrays["CONTROL_LATENTS" if flux else "CONTROL_IMAGES"]
    if not (len(names) == len(modes) == len(scales) == len(images)):
        raise ValueError(f"CONTROLNETS, MODES, SCALES and CONTROL_IMAGES differ in length ({len(names)}, "
                         f"{len(modes)}, {len(scales)}, {len(images)})")
    controls = [(n, s, m, t(img)) for n, s, m, img in zip(names, scales, modes, images)]
    if flux:
        return controls, _unpack_flux(arrays, t)
    added = {key: t(arrays[name]) for name, key in _ADDED.items() if arrays.get(name) is not None}
    inputs = {"sample": t(arrays["SAMPLE"]), "timestep": t(arrays["TIMESTEP"]),
              "encoder_hidden_states": t(arrays["ENCODER_HIDDEN_STATES"]), "added_cond_kwargs": added or None}
    return controls, inputs


def pack_residuals(residuals: list, groups=None) -> dict[str, np.ndarray]:
    """The residuals (UNet: down then mid; Flux: double then single samples) as one flat FP32 tensor, their shapes
    and ``groups`` (default: one list of them all)."""
    flat = [_np(r).reshape(-1) for r in residuals]
    shapes = np.array([list(r.shape) for r in residuals], np.int64)
    return {"RESIDUALS": np.concatenate(flat) if flat else np.zeros(0, np.float32), "RESIDUAL_SHAPES": shapes,
            "RESIDUAL_GROUPS": np.array(groups if groups is not None else [len(residuals)], np.int64)}


def unpack_residuals(arrays: dict[str, np.ndarray], device, dtype) -> Residuals:
    """The inverse of ``pack_residuals``: the residual tensors on ``device`` / ``dtype``, with their groups."""
    flat, shapes = arrays["RESIDUALS"].reshape(-1), arrays["RESIDUAL_SHAPES"]
    sizes = [int(np.prod(s)) for s in shapes]
    if sum(sizes) != flat.size:
        raise ValueError(f"RESIDUALS holds {flat.size} numbers but RESIDUAL_SHAPES describes {sum(sizes)}")
    out, at = [], 0
    for shape, n in zip(shapes, sizes):
        out.append(torch.from_numpy(np.ascontiguousarray(flat[at:at + n])).reshape(tuple(int(d) for d in shape))
                   .to(device, dtype))
        at += n
    groups = arrays.get("RESIDUAL_GROUPS")
    return Residuals(out, [len(out)] if groups is None else groups.reshape(-1))
