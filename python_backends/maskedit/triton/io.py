"""Reading request tensors and building responses/errors in the Python backend."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from maskedit_common.request_id import tagged
from maskedit_common.settings import ServiceSettings

from ..errors import EditError

# The Python backend of Triton 2.51 has no RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED codes; the message keeps
# the intended code as its prefix so clients (and the router) can still tell them apart.
_CODES = {
    "INVALID_ARGUMENT": "INVALID_ARG",
    "CANCELLED": "CANCELLED",
    "UNAVAILABLE": "UNAVAILABLE",
    "RESOURCE_EXHAUSTED": "UNAVAILABLE",
    "DEADLINE_EXCEEDED": "UNAVAILABLE",
    "INTERNAL": "INTERNAL",
}


def error_text(exc: BaseException, request_id: str | None = None) -> str:
    """``CODE: message [request id: ID]``. tritonclient's stream callback passes a client only the error text
    (not the response's id field), so the id must be in the text for a client with several requests pending on
    one stream to tell whose error it is."""
    code = exc.code if isinstance(exc, EditError) else "INTERNAL"
    msg = str(exc) if isinstance(exc, EditError) else f"{type(exc).__name__}: {exc}"
    return tagged(f"{code}: {msg}", request_id)


def as_triton_error(exc: BaseException, request_id: str | None = None) -> "pb_utils.TritonError":
    code = exc.code if isinstance(exc, EditError) else "INTERNAL"
    return pb_utils.TritonError(error_text(exc, request_id), getattr(pb_utils.TritonError, _CODES[code]))


def array(request, name: str) -> np.ndarray | None:
    """A copy of input ``name`` (inputs are released when ``execute`` returns), or None if absent."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else np.array(t.as_numpy(), copy=True)


def scalar(request, name: str):
    a = array(request, name)
    if a is None:
        return None
    if a.size != 1:
        from ..errors import InvalidInput

        raise InvalidInput(f"must hold exactly one value, got shape {list(a.shape)}", name)
    return a.reshape(-1)[0].item() if hasattr(a.reshape(-1)[0], "item") else a.reshape(-1)[0]


def blob(request, name: str) -> bytes:
    value = scalar(request, name)
    return value if isinstance(value, bytes) else str(value).encode()


def tensor(name: str, value) -> "pb_utils.Tensor":
    if isinstance(value, (bytes, str)):
        value = np.array([value if isinstance(value, bytes) else value.encode()], dtype=np.object_)
    elif isinstance(value, dict):
        value = np.array([json.dumps(value).encode()], dtype=np.object_)
    return pb_utils.Tensor(name, np.ascontiguousarray(value))


def response(outputs: dict) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[tensor(k, v) for k, v in outputs.items()])


def error_response(exc: BaseException, request_id: str | None = None) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=as_triton_error(exc, request_id))


def limit_threads(args: dict, service: ServiceSettings, default: int) -> None:
    """Give each stage process its share of the cores: ``MASKEDIT_THREADS_<MODEL>`` (``service.threads``), else
    ``default``."""
    import torch

    n = service.threads_for(args.get("model_name", ""))
    n = default if n is None else n
    if n > 0:
        torch.set_num_threads(n)
