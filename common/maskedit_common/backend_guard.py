"""Backends that only the router may call: Triton's own restricted endpoints, opened by a shared secret.

Every Triton we start with a backend key (``MASKEDIT_BACKEND_KEY_FILE``) is given
``--grpc-restricted-protocol`` / ``--http-restricted-api`` for every endpoint group but ``health``: a call without
the secret in a header is refused by Triton itself, before any model sees it. The router adds the header to every
call it makes on a backend (``maskedit_router.proxy.backend``), the endpoint picker sets it on what the gateway sends
to a pod (``maskedit_router.gateway.picker``), and the launchers generate a key whenever API keys are on
(``maskedit_lab.harness.cluster``).

Tried on the wheel's tritonserver 2.51: HTTP expects the header as named (any case) and answers 403
``This API is restricted, expecting header 'x-maskedit-backend-key'``; gRPC expects it under Triton's prefix,
``triton-grpc-protocol-x-maskedit-backend-key``, and answers UNAVAILABLE ``This protocol is restricted ...``, on
unary calls and on streams alike. A wrong value is refused the same way. ``health`` (live, ready, a model's ready)
stays open for probes and the launcher's readiness wait.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

HEADER = "x-maskedit-backend-key"  # HTTP (Triton's --http-restricted-api)
GRPC_HEADER = f"triton-grpc-protocol-{HEADER}"  # gRPC metadata: Triton prefixes a restricted protocol's key
# Every endpoint group Triton 2.51 knows, but health.
RESTRICTED = ("inference", "metadata", "model-config", "model-repository", "statistics", "shared-memory", "trace",
              "logging")
# What Triton's flag parser accepts as a value (it splits on ',', ':' and '='), and what a header may carry.
_KEY = re.compile(r"^[A-Za-z0-9_.~+/-]{16,512}$")


def triton_args(key: str) -> list[str]:
    """The tritonserver flags that restrict every endpoint but health to callers sending ``key``."""
    groups = ",".join(RESTRICTED)
    return [f"--grpc-restricted-protocol={groups}:{HEADER}={key}", f"--http-restricted-api={groups}:{HEADER}={key}"]


def check(key: str, where: str = "backend key") -> str:
    if not _KEY.match(key):
        raise ValueError(f"{where}: must be 16 to 512 characters of letters, digits and _.~+/- (e.g. "
                         "`openssl rand -hex 24`)")
    return key


def read(path: str | Path) -> str:
    """The key in file ``path`` (its first line), checked; ValueError naming the file, never the key."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"backend key file {path}: {getattr(e, 'strerror', None) or e}") from None
    return check(text.strip().splitlines()[0] if text.strip() else "", f"backend key file {path}")


def create(path: str | Path) -> Path:
    """A new random key in ``path``, readable by its owner only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(24) + "\n")
    return path


def grpc_metadata(key: str | None) -> tuple:
    """The metadata a gRPC call to a guarded backend carries (empty without a key)."""
    return ((GRPC_HEADER, key),) if key else ()
