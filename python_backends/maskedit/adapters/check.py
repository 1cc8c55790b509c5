"""`python -m maskedit.adapters.check FILE`: is ``FILE`` an adapter the served model can run? The backends' own loader
(``convert.load``: Diffusers' ``lora_state_dict`` with the family's converters, every tensor read, each module's
shape checked against the denoiser's, finite weights) run on the denoiser's ``meta``-device skeleton (``skeleton``:
its module tree from the model directory's config, no weights). Prints one JSON line, ``{"ok": true, "modules": n,
"ranks": [...]}`` or ``{"ok": false, "error": "..."}`` (exit 1).

The router's ``/v1/load_lora_adapter`` runs it on the staged copy before it answers 200
(``maskedit_router.frontends.lora_admin``): in a child process, so the router never imports torch or Diffusers, and a
file that takes a parser down takes only the child with it."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from ..errors import InvalidInput
from .library import AdapterFile


def check(path: Path, settings=None) -> dict:
    """What ``convert.load`` makes of ``path`` for the served model: ``{"modules", "ranks"}``; raises
    ``InvalidInput`` with the loader's reason."""
    from ..components import family
    from ..settings import load_settings
    from . import convert, skeleton

    settings = settings or load_settings()
    fam = family(settings)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    f = AdapterFile(Path(path).stem, Path(path), "diffusers", digest)
    adapter = convert.load(f, fam, skeleton.denoiser_skeleton(settings, fam))
    return {"modules": len(adapter.modules), "ranks": adapter.ranks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path, help="the adapter's .safetensors file (a regular file: the caller checked)")
    args = ap.parse_args(argv)
    try:
        out = {"ok": True, **check(args.file)}
    except InvalidInput as e:  # "LORAS: adapter '<stem>': why": the why is the caller's answer
        out = {"ok": False, "error": str(e).split(f"adapter {args.file.stem!r}: ", 1)[-1]}
    except Exception as e:  # noqa: BLE001 - whatever the file did to the loader is the answer
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
