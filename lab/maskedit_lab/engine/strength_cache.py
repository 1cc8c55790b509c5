"""`python -m maskedit_lab.engine.strength_cache`: STRENGTH and the activation cache, measured side by side.

A STRENGTH s edit runs the last ~s x steps of the same schedule (the stock ``get_timesteps``), so the two ways to
cache it are: (a) an entry recorded from an earlier step (a template run at strength 1) serves it from the rows at
its own timesteps (``cache.decision.fits``): what serving does for families that blend the template back every step;
(b) the first step in the key: it needs a template run at its own strength; what serving does for the others
(docs/caching.md, "Strength", says why, from this measurement). For each strength and mask ratio, on one template, this runs:

  exact      the edit uncached (what stock Diffusers computes for it)
  from_s1    a hit on the entry a strength-1 template run recorded (a)
  from_own   a hit on the entry a strength-s template run recorded (b)

and reports each image's fidelity against ``exact`` (SSIM / PSNR, whole image and masked pixels), its denoise time,
and what each template run costs (its denoise time; (b) needs one per strength in use). The images are composited as
served (template outside the mask), so the masked pixels are where they differ.

    python -m maskedit_lab.engine.strength_cache                       # bench preset, CPU -> strength_cache.json
    python -m maskedit_lab.engine.strength_cache --preset klein-bench  # a family that blends (exact unmasked inputs)

Writes ``perf_profiles/results/strength_cache[_<preset>].json`` and its plot.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from maskedit.cache.cost_model import device_slug
from maskedit.cache.store import ActivationStore
from maskedit.decode import Decoder
from maskedit.local import denoise_inputs, run_job
from maskedit.params import parse_params

from ..harness.edit_quality import loadavg, quality
from ..harness.in_process import Harness, png
from .bench_engine import RESULTS

STRENGTHS = (0.3, 0.6, 0.9)
RATIOS = (0.1, 0.3)


def _inputs(h: Harness, mask: np.ndarray, strength: float, register: bool = False, seed: int = 0):
    params = parse_params(h.settings, "a red dress", steps=h.steps, strength=strength, register=register, seed=seed)
    return h.pre(png(h.template), png(mask), params)


def _timed(h: Harness, x, reps: int = 1):
    eng, rt = h.engine("planner")
    try:
        jobs = [run_job(eng, x) for _ in range(reps)]
        if rt is not None:
            rt.flush(timeout=1800)
    finally:
        eng.shutdown()
        if rt is not None:
            rt.close()
    return jobs[-1], statistics.median(j.finished_at - j.started_at for j in jobs)


def run(preset: str = "bench", strengths=STRENGTHS, ratios=RATIOS, reps: int = 3, steps: int | None = None,
        device: str | None = None, dtype: str | None = None) -> list[dict]:
    h = Harness.create(None, preset=preset, steps=steps, device=device, dtype=dtype)
    decoder = Decoder(h.settings)
    empty = np.zeros(h.template.size[::-1], np.uint8)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="maskedit-strength-"))
    try:
        s1 = denoise_inputs(_inputs(h, empty, 1.0, register=True))
        _, s1_record_s = _timed(h, s1)  # (a): one template run, at strength 1
        for strength in tqdm(strengths, desc="strengths"):
            own = replace(h, store=ActivationStore(tmp / f"mem{strength}", tmp / f"disk{strength}", 64 << 30,
                                                   64 << 30))
            own.budget_bytes = h.budget_bytes  # (b)'s entries in a store of their own: the key is the same
            _, own_record_s = _timed(own, denoise_inputs(_inputs(own, empty, strength, register=True)))  # (b)
            for ratio in ratios:
                mask = h.mask(ratio, seed=int(ratio * 1000))
                p = _inputs(h, mask, strength)
                x = denoise_inputs(p)
                exact, exact_s = _timed(h, replace(x, cache_key=None), reps)
                a, a_s = _timed(h, replace(x, cache_key=s1.cache_key), reps)  # as a blending family keys it
                b, b_s = _timed(own, x, reps)
                ref = _rgb(decoder, decoder.decode_latents(exact.result(), p.model_w, p.model_h), p)
                m = np.asarray(mask, bool)
                for name, job, secs, record_s in (("exact", exact, exact_s, None), ("from_s1", a, a_s, s1_record_s),
                                                  ("from_own", b, b_s, own_record_s)):
                    img = _rgb(decoder, decoder.decode_latents(job.result(), p.model_w, p.model_h), p)
                    jc = job.cache
                    rows.append({
                        "strength": strength, "mask_ratio": ratio, "variant": name, "first_step": p.first_step,
                        "steps": h.steps, "run_steps": job.run_steps, "cache": jc.status if jc else "off",
                        "entry_first_step": jc.first if jc is not None and jc.status == "hit" else None,
                        "denoise_s": round(secs, 5), "template_run_s": None if record_s is None else round(record_s, 5),
                        **quality(ref, img, m), "device": device_slug(h.runner.device), "dtype": h.settings.dtype,
                        "load": loadavg()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _rgb(decoder: Decoder, img, p) -> np.ndarray:
    """The image as served (composited), decoded to RGB."""
    from ..harness.edit_quality import rgb

    return rgb(decoder.finish(img, p.template_rgb, p.alpha, False, False))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, style in (("from_s1", "-o"), ("from_own", "--s")):
        for ratio in dict.fromkeys(r["mask_ratio"] for r in rows):
            rs = [r for r in rows if r["variant"] == variant and r["mask_ratio"] == ratio]
            ax.plot([r["strength"] for r in rs], [r["psnr_mask_db"] for r in rs], style,
                    label=f"{variant}, {ratio:.0%} mask")
    t = rows[0]
    ax.set(xlabel="STRENGTH", ylabel="PSNR of the masked pixels vs uncached (dB)",
           title=f"a strength-s hit on a strength-1 entry vs on its own ({t['device']}, {t['dtype']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--strengths", type=float, nargs="*", default=list(STRENGTHS))
    ap.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = run(args.preset, args.strengths, args.ratios, args.reps, args.steps, args.device, args.dtype)
    out = args.out or RESULTS / ("strength_cache.json" if args.preset == "bench" else
                                 f"strength_cache_{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "preset": args.preset}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    for r in rows:
        print({k: r[k] for k in ("strength", "mask_ratio", "variant", "cache", "denoise_s", "template_run_s",
                                 "psnr_mask_db", "ssim_mask_box")})
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
