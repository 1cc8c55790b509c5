"""`python -m maskedit_lab.addons.bench_controlnet_flux`: Flux ControlNet inpainting (the ``flux_controlnet`` family)
in-process against stock Diffusers, side by side in one run on one model: the base edit, +1 and +2 ControlNets
through the service's stages (``LocalEditor``: pre-processing, the denoise loop, decoding) and
``FluxControlNetInpaintPipeline`` (``FluxInpaintPipeline`` for the base edit) with the same components, one request
at a time, every case and both sides alternating in each round after a warm-up (``side_by_side``); medians are
reported. Writes JSON and a plot under ``perf_profiles/results``.

The model is a preset (``flux-cn-bench`` by default) built in a temporary directory with its ControlNet library,
or ``--model-dir`` (with ``controlnets/``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from maskedit import samples
from maskedit.imaging import encode_png
from maskedit.local import LocalEditor
from maskedit.settings import load_settings

from .. import REPO_ROOT
from . import side_by_side

RESULTS = REPO_ROOT / "perf_profiles" / "results"
CASES = {"base": [], "cn1": [{"name": "canny", "scale": 0.8}],
         "cn2": [{"name": "canny", "scale": 0.8}, {"name": "depth", "scale": 0.5, "start": 0.2, "end": 0.9}]}
GUIDANCE = 3.5


def _stock(model_dir: Path, names: list[str]):
    from diffusers import FluxControlNetInpaintPipeline, FluxControlNetModel, FluxInpaintPipeline, \
        FluxMultiControlNetModel

    base = FluxControlNetInpaintPipeline.from_pretrained(model_dir, controlnet=None)
    comps = {k: v for k, v in base.components.items() if k != "controlnet"}
    if not names:
        pipe = FluxInpaintPipeline(**comps, image_encoder=None, feature_extractor=None)
    else:
        nets = [FluxControlNetModel.from_pretrained(model_dir / "controlnets" / n) for n in names]
        pipe = FluxControlNetInpaintPipeline(**comps, controlnet=nets[0] if len(nets) == 1
                                             else FluxMultiControlNetModel(nets))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_kwargs(controls: list[dict], images: list) -> dict:
    if not controls:
        return {}
    if len(controls) == 1:
        return dict(control_image=images[0], controlnet_conditioning_scale=controls[0]["scale"])
    return dict(control_image=images[:len(controls)], controlnet_conditioning_scale=[c["scale"] for c in controls],
                control_guidance_start=[c.get("start", 0.0) for c in controls],
                control_guidance_end=[c.get("end", 1.0) for c in controls], control_mode=[None] * len(controls))


def run(model_dir: Path, steps: int, reps: int) -> list[dict]:
    s = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": "cpu", "MASKEDIT_CACHE": "off"})
    size = s.resolution
    tpl, mask = samples.template(size, size, seed=1), samples.mask(size, size, 0.25, "box", seed=1)
    ctl = [samples.template(size, size, seed=7), samples.template(size, size, seed=8)]
    png = lambda a: encode_png(np.asarray(a))  # noqa: E731
    ed = LocalEditor(s)
    try:
        cases = {}
        for case, controls in CASES.items():
            kw = dict(controls=controls or None, control_images=[png(c) for c in ctl[:len(controls)]])
            pipe = _stock(model_dir, [c["name"] for c in controls])
            cases[case] = (
                lambda i, kw=kw: ed.edit(png(tpl), png(mask), "a hat", seed=i, steps=steps, guidance=GUIDANCE,
                                         use_cache=False, **kw),
                lambda i, pipe=pipe, controls=controls: pipe(
                    prompt="a hat", image=tpl, mask_image=Image.fromarray(mask), height=size, width=size,
                    num_inference_steps=steps, guidance_scale=GUIDANCE, strength=1.0,
                    max_sequence_length=s.max_sequence_length, generator=torch.Generator().manual_seed(i),
                    **_stock_kwargs(controls, ctl)))
        times = side_by_side.alternate(cases, reps)
    finally:
        ed.close()
    return side_by_side.rows(times, {case: len(c) for case, c in CASES.items()}, steps, headline="median")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flux-cn-bench")
    ap.add_argument("--model-dir", type=Path, help="a model with controlnets/ (default: --preset built in a temp dir)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "controlnet_flux.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from maskedit.build_model import build

            model_dir = build(Path(tmp) / "model", args.preset)  # with its controlnets/ library
        rows = run(Path(model_dir), args.steps, args.reps)
    meta = {"preset": args.preset if args.model_dir is None else str(args.model_dir), "steps": args.steps,
            "reps": args.reps, "device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(),
            "machine": platform.machine(), "cores": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    side_by_side.plot(rows, args.out.with_suffix(".png"), f"Flux ControlNet inpainting, {meta['preset']}, "
                      f"{args.steps} steps, CPU float32, {meta['cores']} cores", "seconds per edit (median)")
    for r in rows:
        print(f"{r['case']:5s} served {r['served_s']:.3f} s ({r['served_over_base']:.2f}x base)  stock "
              f"{r['stock_s']:.3f} s  stock/served {r['stock_over_served']:.2f}")


if __name__ == "__main__":
    main()
