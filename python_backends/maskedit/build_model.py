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
    ap.add_argument("--loras", choices=["auto", "yes", "no"], default="auto",
                    help="also write seeded random LoRA adapters to <out>/loras (auto: for tiny presets)")
    ap.add_argument("--controlnets", choices=["auto", "yes", "no"], default="auto",
                    help="also write seeded random ControlNets to <out>/controlnets where the family runs them (auto: "
                         "for tiny presets)")
    args = ap.parse_args(argv)
    args.preset = args.preset or family_class(args.family).tiny_preset
    out = Path(args.out_dir)
    want_loras = args.loras == "yes" or (args.loras == "auto" and "tiny" in args.preset)
    want_controlnets = args.controlnets == "yes" or (args.controlnets == "auto" and "tiny" in args.preset)
    if (out / "model_index.json").exists() and not args.force:
        print(f"model exists: {out}")
        if want_loras and not (out / "loras").is_dir():
            print(f"wrote adapters: {', '.join(p.name for p in build_adapters(out, args.seed))}")
        if want_controlnets and not (out / "controlnets").is_dir():
            _report_controlnets(build_controlnets(out, args.seed))
        return
    family = preset_family(args.preset)
    family.build(out, args.preset, args.seed)
    p = family.presets[args.preset]
    print(f"built {args.preset} ({family.name}) model in {out}: {json.dumps(asdict(p) if is_dataclass(p) else p)}")
    if want_loras:
        print(f"wrote adapters: {', '.join(p.name for p in build_adapters(out, args.seed))}")
    if want_controlnets:
        _report_controlnets(build_controlnets(out, args.seed))


def _report_controlnets(paths: list[Path]) -> None:
    if paths:
        print(f"wrote ControlNets: {', '.join(p.name for p in paths)}")


def build_controlnets(model_dir: Path, seed: int = 0) -> list[Path]:
    """Seeded random ControlNets for the model in ``model_dir`` in ``<model_dir>/controlnets`` (the family's
    ``build_controlnets``; none for a family that runs none)."""
    from .families import family_for

    return family_for(model_dir).build_controlnets(Path(model_dir) / "controlnets", seed)


def build_adapters(model_dir: Path, seed: int = 0) -> list[Path]:
    """Seeded random LoRA adapters for the model in ``model_dir`` (``maskedit.adapters.build``)."""
    from .adapters.build import write_library
    from .families import family_for
    from .settings import load_settings

    settings = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": "cpu"})
    fam = family_for(model_dir)
    return write_library(model_dir, fam, fam.load_denoiser(settings), seed=seed)


if __name__ == "__main__":
    main()
