"""`maskedit-build-model DIR --preset NAME`: write a model directory for any family's preset (seeded random weights,
saved with ``save_pretrained``), e.g. ``tiny`` (Flux Fill, the default), ``sd2-tiny``, ``sdxl-bench``."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, is_dataclass
from pathlib import Path

from .families import REGISTRY, all_presets, family_class, preset_family


def build(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    return preset_family(preset).build(out_dir, preset, seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=all_presets(), help="any family's preset (default: --family's tiny preset)")
    ap.add_argument("--family", choices=list(REGISTRY), default="flux_fill", help="build this family's tiny preset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if the directory exists")
    args = ap.parse_args(argv)
    args.preset = args.preset or family_class(args.family).tiny_preset
    out = Path(args.out_dir)
    if (out / "model_index.json").exists() and not args.force:
        print(f"model exists: {out}")
        return
    family = preset_family(args.preset)
    family.build(out, args.preset, args.seed)
    p = family.presets[args.preset]
    print(f"built {args.preset} ({family.name}) model in {out}: {json.dumps(asdict(p) if is_dataclass(p) else p)}")


if __name__ == "__main__":
    main()
