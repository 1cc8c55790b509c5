"""`python -m maskedit_lab.addons.bench_controlnet`: SDXL ControlNet inpainting in-process against stock Diffusers, side
by side in one run on one model: the base edit, +1 and +2 ControlNets through the service's stages (``LocalEditor``:
pre-processing, the denoise loop, decoding) and ``StableDiffusionXLControlNetInpaintPipeline`` with the same components
one request at a time, run alternately (``side_by_side``: the fastest run of each is reported, on a shared machine the
fastest is the least disturbed). Writes JSON and a plot under ``perf_profiles/results``.

The model is a preset built in a temporary directory with its seeded ControlNets (``build_controlnets``), or
``--model-dir`` (with ``controlnets/``)."""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from maskedit import samples
from maskedit.families import family_for
from maskedit.imaging import encode_png
from maskedit.local import LocalEditor
from maskedit.settings import load_settings

from .. import REPO_ROOT
from . import side_by_side

RESULTS = REPO_ROOT / "perf_profiles" / "results"
CASES = {"base": [], "cn1": [{"name": "canny", "scale": 0.8}],
         "cn2": [{"name": "canny", "scale": 0.8}, {"name": "depth", "scale": 0.5, "start": 0.2, "end": 0.9}]}


def _stock(model_dir: Path, names: list[str]):
    from diffusers import (ControlNetModel, DiffusionPipeline, StableDiffusionXLControlNetInpaintPipeline,
                           StableDiffusionXLInpaintPipeline)
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    base = DiffusionPipeline.from_pretrained(model_dir)
    if not names:
        pipe = StableDiffusionXLInpaintPipeline(**base.components)
    else:
        nets = [ControlNetModel.from_pretrained(model_dir / "controlnets" / n) for n in names]
        pipe = StableDiffusionXLControlNetInpaintPipeline(
            **base.components, controlnet=nets[0] if len(nets) == 1 else MultiControlNetModel(nets))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(model_dir: Path, steps: int, reps: int) -> list[dict]:
    s = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": "cpu"})
    size = s.resolution
    tpl, mask = samples.template(size, size, seed=1), samples.mask(size, size, 0.25, "box", seed=1)
    ctl = [samples.template(size, size, seed=7), samples.template(size, size, seed=8)]
    ed = LocalEditor(s)
    try:
        cases = {}
        for case, controls in CASES.items():
            kw = dict(controls=controls or None, control_images=[encode_png(np.asarray(c)) for c in ctl[:len(controls)]])
            extra = {}
            if controls:
                one = len(controls) == 1
                extra = dict(control_image=ctl[0] if one else ctl[:2],
                             controlnet_conditioning_scale=controls[0]["scale"] if one else [c["scale"] for c in controls],
                             **({} if one else {"control_guidance_start": [c.get("start", 0.0) for c in controls],
                                                "control_guidance_end": [c.get("end", 1.0) for c in controls]}))
            pipe = _stock(model_dir, [c["name"] for c in controls])
            cases[case] = (
                lambda i, kw=kw: ed.edit(encode_png(np.asarray(tpl)), encode_png(np.asarray(mask)), "a hat", seed=i,
                                         steps=steps, use_cache=False, **kw),
                lambda i, pipe=pipe, extra=extra: pipe(
                    prompt="a hat", image=tpl, mask_image=Image.fromarray(mask), height=size, width=size,
                    num_inference_steps=steps, guidance_scale=7.5, strength=1.0,
                    generator=torch.Generator().manual_seed(i), **extra))
        times = side_by_side.alternate(cases, reps)
    finally:
        ed.close()
    return side_by_side.rows(times, {case: len(c) for case, c in CASES.items()}, steps, headline="fastest")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sdxl-bench")
    ap.add_argument("--model-dir", type=Path, help="a model with controlnets/ (default: --preset built in a temp dir)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "controlnet_sdxl.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from maskedit.build_model import build

            model_dir = build(Path(tmp) / "model", args.preset)
            family_for(model_dir).build_controlnets(model_dir / "controlnets")
        rows = run(Path(model_dir), args.steps, args.reps)
    meta = {"preset": args.preset if args.model_dir is None else str(args.model_dir), "steps": args.steps,
            "reps": args.reps, "device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(),
            "machine": platform.machine(), "cores": __import__("os").cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    side_by_side.plot(rows, args.out.with_suffix(".png"), f"SDXL ControlNet inpainting, {meta['preset']}, "
                      f"{args.steps} steps, CPU float32, {meta['cores']} cores",
                      "seconds per edit (fastest of the runs)")
    for r in rows:
        print(f"{r['case']}: served {r['served_s']:.3f} s ({r['served_over_base']}x base), stock {r['stock_s']:.3f} s "
              f"(stock/served {r['stock_over_served']})")


if __name__ == "__main__":
    main()
