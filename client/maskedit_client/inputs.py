"""The request side of an edit: images encoded to bytes, and the ``InferInput`` tensors of the ``edit`` ensemble
(docs/api.md) built from ``EditClient.submit``'s arguments. Pure functions: nothing here talks to a server."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

from .controls import control_images_input, controls_json


def encode_image(image) -> bytes:
    """Bytes of an encoded image from a path, bytes, PIL image or HxW(x3) uint8 array."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, (str, Path)):
        return Path(image).read_bytes()
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"cannot encode {type(image).__name__} as an image")


def bytes_input(name: str, value: bytes) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value], dtype=np.object_))
    return t


def scalar_input(name: str, value, dtype: str, np_dtype) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], dtype)
    t.set_data_from_numpy(np.array([value], dtype=np_dtype))
    return t


def loras_json(loras) -> str:
    """The ``LORAS`` JSON text of ``loras`` (see ``EditClient.submit``)."""
    if isinstance(loras, (str, bytes)):
        return loras.decode() if isinstance(loras, bytes) else loras
    if isinstance(loras, dict) and "name" not in loras:
        loras = list(loras.items())
    if isinstance(loras, dict):
        loras = [loras]
    return json.dumps([d if isinstance(d, dict) else {"name": d[0], "scale": float(d[1]) if len(d) > 1 else 1.0}
                       for d in loras])


def edit_inputs(template, mask, prompt, seed: int | None = None, steps: int | None = None,
                guidance: float | None = None, raw_output: bool = False, template_seed: int | None = None,
                use_cache: bool | None = None, register: bool = False, deadline_ms: int | None = None,
                progress: bool = False, negative_prompt: str | None = None, loras=None, controls=None,
                control_images=None, temporal=None, reference_images=None, strength: float | None = None,
                padding_mask_crop: int | None = None, guidance_rescale: float | None = None,
                true_cfg_scale: float | None = None, output_format: str | None = None,
                output_quality: int | None = None) -> list[grpcclient.InferInput]:
    """The input tensors of one edit (the arguments as ``EditClient.submit`` documents them); an argument left at
    its default sends no tensor, so the server's default applies."""
    inputs = [bytes_input("TEMPLATE", encode_image(template)), bytes_input("MASK", encode_image(mask)),
              bytes_input("PROMPT", prompt.encode() if isinstance(prompt, str) else prompt)]
    if negative_prompt is not None:
        inputs.append(bytes_input("NEGATIVE_PROMPT", negative_prompt.encode()))
    if loras:
        inputs.append(bytes_input("LORAS", loras_json(loras).encode()))
    if controls:
        inputs.append(bytes_input("CONTROLS", controls_json(controls).encode()))
    if temporal is not None:  # a dict or its JSON text; {"policy": "off"} turns a server default off
        text = temporal if isinstance(temporal, (str, bytes)) else json.dumps(temporal)
        inputs.append(bytes_input("TEMPORAL", text.encode() if isinstance(text, str) else text))
    if control_images:
        inputs.append(control_images_input(control_images, encode_image, grpcclient.InferInput))
    if reference_images:
        inputs.append(control_images_input(reference_images, encode_image, grpcclient.InferInput,
                                           "REFERENCE_IMAGES"))
    if seed is not None:
        inputs.append(scalar_input("SEED", seed, "INT64", np.int64))
    if steps is not None:
        inputs.append(scalar_input("STEPS", steps, "INT32", np.int32))
    if guidance is not None:
        inputs.append(scalar_input("GUIDANCE", guidance, "FP32", np.float32))
    if raw_output:
        inputs.append(scalar_input("RAW_OUTPUT", True, "BOOL", np.bool_))
    if template_seed is not None:
        inputs.append(scalar_input("TEMPLATE_SEED", template_seed, "INT64", np.int64))
    if use_cache is not None:
        inputs.append(scalar_input("USE_CACHE", bool(use_cache), "BOOL", np.bool_))
    if register:
        inputs.append(scalar_input("REGISTER", True, "BOOL", np.bool_))
    if deadline_ms is not None:
        inputs.append(scalar_input("DEADLINE_MS", int(deadline_ms), "INT64", np.int64))
    if progress:
        inputs.append(scalar_input("PROGRESS", True, "BOOL", np.bool_))
    # the stock inpainting pipelines' own parameters (docs/api.md, "Diffusers parameters")
    if strength is not None:
        inputs.append(scalar_input("STRENGTH", float(strength), "FP64", np.float64))
    if padding_mask_crop is not None:
        inputs.append(scalar_input("PADDING_MASK_CROP", int(padding_mask_crop), "INT32", np.int32))
    if guidance_rescale is not None:
        inputs.append(scalar_input("GUIDANCE_RESCALE", guidance_rescale, "FP32", np.float32))
    if true_cfg_scale is not None:
        inputs.append(scalar_input("TRUE_CFG_SCALE", true_cfg_scale, "FP32", np.float32))
    if output_format is not None:
        inputs.append(bytes_input("OUTPUT_FORMAT", output_format.encode()))
    if output_quality is not None:
        inputs.append(scalar_input("OUTPUT_QUALITY", int(output_quality), "INT32", np.int32))
    return inputs
