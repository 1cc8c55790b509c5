"""`python -m maskedit_router.probe HOST:PORT`: exit 0 if that Triton answers a real edit request in time.

The Kubernetes readiness probe of a Triton pod: Triton 2.51 keeps saying ready after a Python stub died, so the
pod is ready only while a request through every stage of the ``edit`` ensemble (an empty mask: no model work)
comes back. The same probe the router's health checker sends.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from maskedit_common import backend_guard
from maskedit_common.settings import load_settings

from .proxy.backend import Backend
from .proxy.health import probe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("addr", help="Triton gRPC address, e.g. 127.0.0.1:8001")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--backend-key-file", type=Path, default=load_settings().security.backend_key_file,
                    help="the backend key, for a guarded Triton (default: MASKEDIT_BACKEND_KEY_FILE)")
    args = ap.parse_args(argv)
    try:
        key = backend_guard.read(args.backend_key_file) if args.backend_key_file else None
    except ValueError as e:
        ap.error(str(e))
    backend = Backend(args.addr, key=key)
    try:
        ok = probe(backend, args.timeout)
    finally:
        backend.close()
    print(f"{args.addr}: {'answered' if ok else 'did not answer'} an edit within {args.timeout:g} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
