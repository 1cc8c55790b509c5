"""How a request's tenant travels from whoever checked its API key to the backend's fair-share queue: the names both
sides use (``maskedit_router.access.tenancy`` / ``picker`` write them, ``maskedit.fair_share`` reads them).

Two channels, one per path:
- the router forwards a ``ModelInferRequest`` itself, so it sets request **parameters** (``PARAMS``);
- the endpoint picker never touches the gRPC body the gateway sends on: it answers with **header** mutations
  (``HEADERS``: remove the client's copies, set its own), and Triton forwards those headers to the backend as
  request parameters of the same (lowercased) names when started with ``TRITON_ARGS``. Triton 2.51 forwards them
  on gRPC (unary and every request of a stream) and HTTP ``/infer``, not on the HTTP ``/generate`` endpoints, so
  for those the picker writes the same names into the JSON body, whose extra top-level keys ``/generate`` turns
  into request parameters.

A forwarded header arrives as a string parameter, after the request's own parameters; a request parameter of a
header's name is the client's (the picker strips the header, never the body's copy), so a name given twice with
two values is refused by the backend, whichever copy comes first.
"""

TENANT_PARAM = "maskedit_tenant"
WEIGHT_PARAM = "maskedit_tenant_weight"
TENANT_HEADER = "x-maskedit-tenant"
WEIGHT_HEADER = "x-maskedit-tenant-weight"
HEADERS = (TENANT_HEADER, WEIGHT_HEADER)
FORWARD_PATTERN = "^x-maskedit-tenant(-weight)?$"  # RE2, matched against the lowercased header name
TRITON_ARGS = (f"--grpc-header-forward-pattern={FORWARD_PATTERN}", f"--http-header-forward-pattern={FORWARD_PATTERN}")


def weight_text(weight: float) -> str:
    """A weight as header text: ``repr`` of the float, so the backend reads back exactly the key file's number."""
    return repr(float(weight))
