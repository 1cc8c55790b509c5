"""The ``CONTROLS`` / ``CONTROL_IMAGES`` inputs of an edit (ControlNets from the server's library, docs/controlnet.md).
The client ships without server code, so this mirrors the schema (``maskedit_common.controls``) rather than
importing it; the server checks every value."""

from __future__ import annotations

import json

import numpy as np

_KEYS = ("name", "scale", "start", "end")


def controls_json(controls) -> str:
    """The ``CONTROLS`` JSON text of ``controls``: a list of ``(name, scale[, start, end])`` tuples or
    ``{"name", "scale", "start", "end", "mode", "preprocess"}`` objects, one object, or the JSON text itself."""
    if isinstance(controls, (str, bytes)):
        return controls.decode() if isinstance(controls, bytes) else controls
    if isinstance(controls, dict):
        controls = [controls]
    out = []
    for c in controls:
        if isinstance(c, str):
            c = (c,)
        out.append(dict(c) if isinstance(c, dict) else {k: (v if k == "name" else float(v)) for k, v in zip(_KEYS, c)})
    return json.dumps(out)


def control_images_input(images, encode_image, infer_input, name: str = "CONTROL_IMAGES"):
    """One ``CONTROL_IMAGES`` tensor (BYTES, shape [n]) of ``images`` (paths, bytes or PIL images, in the order of
    the controls), each encoded with ``encode_image``; ``name``: another list of images (``REFERENCE_IMAGES``)."""
    data = np.array([encode_image(im) for im in images], dtype=np.object_)
    t = infer_input(name, [len(data)], "BYTES")
    t.set_data_from_numpy(data)
    return t
