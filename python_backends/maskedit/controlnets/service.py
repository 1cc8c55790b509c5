"""The ``controlnet`` Triton model's work, without Triton: one call (``wire``'s request) is one request's
ControlNets at one step; it loads each named ControlNet from the library (the same ``MASKEDIT_CONTROLNET_DIR``,
by name only, cached) and returns their merged residuals — the family's ``remote_residuals``: for the UNet families
each control's ``control_residuals`` summed in order as ``MultiControlNetModel`` sums them, for the Flux families
``controlnets.flux_remote`` (merged as ``FluxMultiControlNetModel`` merges them) — what the in-process path
computes."""

from __future__ import annotations

import time

import numpy as np
import torch
from maskedit_common.controls import ControlSpec

from ..components import family
from ..device import torch_dtype
from ..errors import EditError, InvalidInput
from .job import ActiveControl
from .library import ControlNetLibrary
from .wire import pack_residuals, unpack_request


class ControlNetService:
    def __init__(self, settings):
        self.settings = settings
        self.family = family(settings)
        self.device = torch.device(settings.torch_device)
        self.dtype = torch_dtype(settings)
        self.library = ControlNetLibrary(settings.controlnets, self.family, settings)

    @torch.no_grad()
    def run(self, arrays: dict) -> dict:
        """``wire.pack_request``'s arrays in, ``wire.pack_residuals``'s out. A bad name or ControlNet raises
        ``InvalidInput`` naming CONTROLS (the library's checks)."""
        t0 = time.perf_counter()
        controls, inputs = unpack_request(arrays, self.device, self.dtype)
        actives = []
        for i, (name, scale, mode, image) in enumerate(controls):
            spec = ControlSpec(name, scale, mode=mode)
            try:
                model = self.library.load(spec, i)
            except InvalidInput:
                raise
            except Exception as e:  # unreadable weights and the like: say which, not where (no server paths)
                raise EditError(f"control {i}: ControlNet {name!r} could not be loaded ({type(e).__name__})",
                                "CONTROLS") from e
            actives.append((ActiveControl(spec, model, image), scale))
        if not actives:
            raise ValueError("CONTROLNETS: names no ControlNet")
        out = pack_residuals(*self.family.remote_residuals(actives, inputs))  # as its Multi-ControlNet merges them
        out["COMPUTE_S"] = np.array([time.perf_counter() - t0], np.float64)  # the caller's round trip minus this:
        return out  # the BLS overhead
