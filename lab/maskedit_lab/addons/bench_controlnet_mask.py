"""`python -m maskedit_lab.addons.bench_controlnet_mask`: mask-aware, cached Flux ControlNet
(``maskedit.cache.controlnet``) against full ControlNet compute, side by side in one run on one model (``flux-cn-bench``
by default), one canny ControlNet at scale 0.8, through the service's stages in process (``LocalEditor`` with an
activation cache).

The template is registered once with the control (a template run records the transformer's and the ControlNet's
rows); then, per mask ratio (0.1 / 0.2 / 0.5 of the image, a box), the same request runs uncached (``full``: the
ControlNet and the transformer compute every token) and cached (``hit``: both compute the masked tokens), the two
interleaved rep by rep so the shared host's load drifts over both alike. Reported: medians of the denoise time
(the step loop: what the cache changes) and of the whole edit, the speed-ups, and SSIM / PSNR of the hit's output
image against the full path's with the same seed. Rows go into ``perf_profiles/results/addons.json`` (case
``controlnet-mask``; other rows kept) and ``controlnet_mask.json`` / ``.png``."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from maskedit import samples
from maskedit.cache.flux import FluxCacheHooks
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.imaging import encode_png
from maskedit.local import LocalEditor
from maskedit.settings import load_settings

from .. import REPO_ROOT
from ..harness.edit_quality import loadavg, quality, rgb

RESULTS = REPO_ROOT / "perf_profiles" / "results"
CONTROLS = [{"name": "canny", "scale": 0.8}]
RATIOS = (0.1, 0.2, 0.5)
GUIDANCE = 3.5
CASE = "controlnet-mask"


def run(model_dir: Path, steps: int, reps: int, tmp: Path) -> tuple[list[dict], dict]:
    s = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": "cpu"})
    size = s.resolution
    png = lambda a: encode_png(np.asarray(a))  # noqa: E731
    tpl, ctl = png(samples.template(size, size, seed=1)), [png(samples.template(size, size, seed=7))]
    store = ActivationStore(tmp / "mem", tmp / "disk", 4 << 30, 4 << 30)
    ed = LocalEditor(s, cache=lambda t: CacheRuntime(FluxCacheHooks.of(t), store), store=store)
    loads = [loadavg()]
    rows = []
    try:
        kw = dict(steps=steps, guidance=GUIDANCE, controls=CONTROLS, control_images=ctl)
        _, _, reg = ed.edit(tpl, png(np.zeros((size, size), np.uint8)), "a hat", register=True, **kw)
        assert reg.cache.status == "record", reg.cache.status
        ed.runner.cache.flush()
        for ratio in RATIOS:
            m = samples.mask(size, size, ratio, "box", seed=3)
            mask = png(m)
            got: dict = {"full": [], "hit": []}
            for i in range(reps + 1):  # the first round warms up
                for case in ("full", "hit"):
                    t0 = time.perf_counter()
                    out, _, job = ed.edit(tpl, mask, "a hat", seed=5, use_cache=case == "hit", **kw)
                    e2e = time.perf_counter() - t0
                    if case == "hit":
                        assert job.cache.status == "hit", job.cache.status
                        computed = int(job.cache.idx_c.numel()) / job.inputs.latents.shape[0]
                    if i:
                        got[case].append((e2e, job.finished_at - job.started_at, out))
                    loads.append(loadavg())
            full_img, hit_img = rgb(got["full"][0][2]), rgb(got["hit"][0][2])
            med = {c: (statistics.median(x[0] for x in got[c]), statistics.median(x[1] for x in got[c]))
                   for c in got}
            rows.append({
                "case": CASE, "mask_ratio": ratio, "computed_tokens": round(computed, 3), "preset": None,
                "device": "cpu", "dtype": "float32", "steps": steps, "controls": CONTROLS,
                "latency_s": round(med["hit"][0], 4), "full_latency_s": round(med["full"][0], 4),
                "denoise_s": round(med["hit"][1], 4), "full_denoise_s": round(med["full"][1], 4),
                "speedup": round(med["full"][1] / med["hit"][1], 3),
                "e2e_speedup": round(med["full"][0] / med["hit"][0], 3),
                **quality(full_img, hit_img, np.asarray(m) > 127),
                "latencies_s": {c: [round(x[0], 4) for x in got[c]] for c in got},
                "denoise_runs_s": {c: [round(x[1], 4) for x in got[c]] for c in got},
            })
    finally:
        ed.close()
    return rows, {"start": loads[0], "max": max(loads), "end": loads[-1]}


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["full_denoise_s"] for r in rows], 0.4, label="full ControlNet + transformer")
    ax.bar(x + 0.2, [r["denoise_s"] for r in rows], 0.4, label="mask-aware (cache hit)")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["denoise_s"], f"{r['speedup']:.2f}x\nSSIM {r['ssim']:.3f}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(x, [f"mask {r['mask_ratio']}" for r in rows])
    ax.set_ylabel("denoise seconds per edit (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flux-cn-bench")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "controlnet_mask.json")
    ap.add_argument("--addons", type=Path, default=RESULTS / "addons.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        from maskedit.build_model import build

        model_dir = build(Path(tmp) / "model", args.preset)  # with its controlnets/ library
        rows, load = run(Path(model_dir), args.steps, args.reps, Path(tmp))
    for r in rows:
        r["preset"] = args.preset
    meta = {"preset": args.preset, "steps": args.steps, "reps": args.reps, "device": "cpu", "dtype": "float32",
            "threads": torch.get_num_threads(), "cores": os.cpu_count(), "load_avg": load,
            "speedup": "full_denoise_s / denoise_s (the step loop); e2e_speedup: whole edits"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if args.addons.exists():  # the add-ons file keeps its other rows; this case's are replaced
        addons = json.loads(args.addons.read_text())
        addons["rows"] = [r for r in addons["rows"] if r.get("case") != CASE] + rows
        addons.setdefault("meta", {})[CASE] = meta
        args.addons.write_text(json.dumps(addons, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"), f"Mask-aware Flux ControlNet, {args.preset}, {args.steps} steps, "
                                            f"CPU float32, load {load['start']}-{load['max']}")
    for r in rows:
        print(f"mask {r['mask_ratio']}: denoise full {r['full_denoise_s']:.2f} s hit {r['denoise_s']:.2f} s "
              f"({r['speedup']:.2f}x, e2e {r['e2e_speedup']:.2f}x) SSIM {r['ssim']:.4f} PSNR {r['psnr_db']:.1f} dB; "
              f"in the mask SSIM {r['ssim_mask_box']:.4f} PSNR {r['psnr_mask_db']:.1f} dB")


if __name__ == "__main__":
    main()
