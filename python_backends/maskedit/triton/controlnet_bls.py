"""The denoise loop's side of the ``controlnet`` model: one BLS call (``wire`` arrays in and out). Triton's
``exec`` blocks the calling thread (``TritonProvider`` runs it on its own pool). Its ``timeout`` is passed, but
Triton does not end a call the controlnet model is already executing: ``TritonProvider`` enforces the deadline."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from ..controlnets.wire import OUTPUTS

MODEL = "controlnet"


def transport(model: str = MODEL, timeout_s: float = 30.0):
    def call(arrays: dict) -> dict:
        request = pb_utils.InferenceRequest(
            model_name=model, requested_output_names=list(OUTPUTS),
            inputs=[pb_utils.Tensor(k, v) for k, v in arrays.items()], timeout=int(timeout_s * 1e6))
        response = request.exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        out = {n: pb_utils.get_output_tensor_by_name(response, n) for n in OUTPUTS}
        return {n: t.as_numpy() for n, t in out.items() if t is not None}

    return call
