"""`maskedit-bench-temporal` (``make bench-temporal``): temporal reuse on top of mask-aware reuse, four sides
interleaved in one run on one model, one registered template, masks covering an exact fraction of the tokens:

  full           no activation cache, no temporal reuse (stock computation)
  mask-only      a cache hit (the planner's plan), every step computed
  temporal-only  no activation cache, the temporal policy
  both           a cache hit with the temporal policy (reuse on its masked rows)

``--negative-prompt``: every request carries it, so a family with true classifier-free guidance (Qwen-Image-Edit at
its default scale) makes a negative call each step, which reuses on its own stream; guided requests run uncached, so
their mask-only and both sides are the other two's work.

Requests on a ``flux_controlnet`` preset carry one canny ControlNet at scale 0.8 (``--controls``; the family's point:
the ControlNet runs on every step, reused or not, since the blocks after the skipped ones take this step's residuals,
as under Diffusers' and cache-dit's hooks); the other families none.

Policies: a step mask computing ``--fraction`` of the steps (the issue's target setting, exact computed fraction),
Diffusers' First Block Cache and TaylorSeer (cache-dit's calibrator) at a threshold: what those compute and how
close they stay to full computation on these random weights is reported as it comes out (the parity tests carry
their quality against the libraries). Rows ``family, preset, mask_ratio, policy, params, side, computed_fraction,
speedup, ssim, psnr_db`` (speed-ups over ``full`` in the same run; SSIM / PSNR of the decoded, composited image
against ``full``'s), and per policy the compounding check ``both / (mask-only x temporal-only)``.

    maskedit-bench-temporal                                    # bench preset, mask 0.2, 10 steps -> temporal.json
    maskedit-bench-temporal --presets tiny --reps 1 --steps 5  # a quick check of the command
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from maskedit import samples
from maskedit.cache.cost_model import device_slug
from maskedit.decode import Decoder
from maskedit.families import preset_family
from maskedit.local import run_job
from maskedit_common.cost_model import CostModel
from maskedit_common.temporal import parse, step_mask

from .. import REPO_ROOT
from ..harness.edit_quality import loadavg, quality
from ..harness.in_process import Harness, png

RESULTS = REPO_ROOT / "perf_profiles" / "results"
SIDES = ("full", "mask-only", "temporal-only", "both")
# Targets (issue 40) at mask ratio 0.2 with a step mask computing 60 % of the steps.
CONTROLS = [{"name": "canny", "scale": 0.8}]  # a flux_controlnet preset's requests (``--controls``)
COMPOUND_TARGET = 0.9  # both >= 0.9 x (mask-only x temporal-only)
FLUX_FILL_BENCH_TARGET = 3.5  # both >= 3.5x over full on flux_fill's bench preset


def policies(steps: int, fraction: float, threshold: float, unet: bool = False) -> dict:
    """Name -> TEMPORAL spec (dict) of the policies measured. On a UNet (DeepCache-style) the first down block and
    the last up block run (``fn = bn = 1``, DeepCache's shallowest branch); First Block Cache is then DBCache."""
    blocks = {"fn": 1, "bn": 1} if unet else {}
    first = {"policy": "dbcache", "threshold": threshold, **blocks} if unet else \
        {"policy": "fbcache", "threshold": threshold}
    return {"step_mask": {"policy": "steps", "steps": step_mask(steps, fraction), **blocks},
            "fbcache": first, "taylorseer": {"policy": "taylorseer", "order": 2, "threshold": threshold, **blocks}}


def request_controls(family: str, controls: str) -> list | None:
    """The CONTROLS a preset's requests carry: ``auto`` gives a ``flux_controlnet`` preset ``CONTROLS`` and the
    others none; ``none``; or a JSON list for every preset."""
    if controls == "none":
        return None
    if controls == "auto":
        return CONTROLS if family == "flux_controlnet" else None
    return json.loads(controls)


def run_preset(preset: str, ratios, steps: int, reps: int, fraction: float, threshold: float,
               device: str | None = None, dtype: str | None = None, controls: str = "auto",
               negative_prompt: str | None = None) -> list[dict]:
    h = Harness.create(preset=preset, steps=steps, device=device, dtype=dtype)
    h.negative_prompt = negative_prompt
    ctl = request_controls(h.runner.family.name, controls)
    if ctl:  # every request, the registered template's included (the cache key covers the controls)
        res = h.settings.resolution
        h.controls = json.dumps(ctl)
        h.control_images = tuple(png(samples.template(res, res, seed=7 + k)) for k in range(len(ctl)))
    profile = h.settings.cost_profile_for(device_slug(h.runner.device))
    h.cost = CostModel.load_file(profile) if profile.exists() else CostModel.fallback()
    h.register()
    decoder = Decoder(h.settings)
    off, _ = h.engine("off")
    hit, rt = h.engine("planner")
    specs = policies(h.steps, fraction, threshold, unet=h.hooks.layout == "per_block")
    family = h.runner.family.name
    rows = []
    try:
        for ratio in ratios:
            mask = h.mask(ratio, seed=int(ratio * 1000))
            x = h.inputs(mask)
            runs = {("full", None): (off, x), ("mask-only", None): (hit, x)}
            for name, spec in specs.items():
                t = replace(x, temporal=spec)
                runs[("temporal-only", name)] = (off, t)
                runs[("both", name)] = (hit, t)
            times = {k: [] for k in runs}
            jobs = {}
            for eng, xi in runs.values():  # once untimed: first calls, lazy imports (cache-dit's TaylorSeer state)
                run_job(eng, xi)
            for _ in tqdm(range(reps), desc=f"{preset} mask {ratio}"):  # interleaved: drift hits every side alike
                for k, (eng, xi) in runs.items():
                    job = run_job(eng, xi)
                    times[k].append(job.finished_at - job.started_at)
                    jobs[k] = job
            m = np.kron(np.asarray(x.token_mask, bool).reshape(x.model_h // h.pre.patch, -1),
                        np.ones((h.pre.patch, h.pre.patch), bool)).astype(bool)
            alpha = m.astype(np.float32)[..., None]  # composited as served: the template outside the mask
            tpl = np.asarray(h.template.resize((x.model_w, x.model_h)), np.float32)

            def image(job):
                raw = np.asarray(decoder.decode_latents(job.result(), x.model_w, x.model_h), np.float32)
                return (alpha * raw + (1 - alpha) * tpl).round().astype(np.uint8)

            ref = image(jobs[("full", None)])
            full_s = statistics.median(times[("full", None)])
            load = loadavg()
            for (side, name), job in jobs.items():
                d = statistics.median(times[(side, name)])
                info = job.temporal.info() if job.temporal is not None else {}
                q = quality(ref, image(job), m) if side != "full" else {"ssim": 1.0, "psnr_db": None}
                rows.append({
                    "family": family, "preset": preset, "mask_ratio": ratio, "side": side,
                    "negative_prompt": negative_prompt,
                    "temporal_uncond_steps": info.get("temporal_uncond_steps"),
                    "policy": name or "none", "params": parse(specs[name], h.steps).as_dict() if name else None,
                    "controls": ctl,
                    "computed_fraction": info.get("temporal_computed_fraction", 1.0),
                    "temporal_steps": info.get("temporal_steps", ""), "cache": job.cache.status if job.cache else "off",
                    "denoise_s": round(d, 5), "speedup": round(full_s / d, 3), "ssim": q["ssim"],
                    "psnr_db": q["psnr_db"] if q["psnr_db"] is None or np.isfinite(q["psnr_db"]) else None,
                    "steps": h.steps, "device": device_slug(h.runner.device),
                    "dtype": h.settings.dtype, "loadavg": load})
    finally:
        off.shutdown()
        hit.shutdown()
        rt.close()
    return rows


def summary(rows: list[dict], fraction: float) -> list[dict]:
    """Per preset, mask ratio and policy: the compounding ratio and the targets where they apply."""
    out = []
    by = {(r["preset"], r["mask_ratio"], r["side"], r["policy"]): r for r in rows}
    for (preset, ratio, side, policy), r in by.items():
        if side != "both":
            continue
        mask_only = by[(preset, ratio, "mask-only", "none")]["speedup"]
        temporal_only = by[(preset, ratio, "temporal-only", policy)]["speedup"]
        s = {"family": r["family"], "preset": preset, "mask_ratio": ratio, "policy": policy,
             "controls": r.get("controls"),
             "computed_fraction": r["computed_fraction"], "mask_only": mask_only, "temporal_only": temporal_only,
             "both": r["speedup"], "compound": round(r["speedup"] / (mask_only * temporal_only), 3)}
        if policy == "step_mask" and abs(ratio - 0.2) < 1e-9:
            s["compound_target_met"] = s["compound"] >= COMPOUND_TARGET
            if r["family"] == "flux_fill" and preset == "bench":
                s["speedup_target_met"] = r["speedup"] >= FLUX_FILL_BENCH_TARGET
        out.append(s)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["preset"], r["mask_ratio"], r["policy"]) for r in rows if r["policy"] != "none"})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.2
    for k, side in enumerate(SIDES):
        ys = []
        for preset, ratio, policy in groups:
            pol = "none" if side in ("full", "mask-only") else policy
            ys.append(next(r["speedup"] for r in rows if (r["preset"], r["mask_ratio"], r["policy"], r["side"]) ==
                           (preset, ratio, pol, side)))
        ax.bar(np.arange(len(groups)) + (k - 1.5) * width, ys, width, label=side)
    ax.set_xticks(np.arange(len(groups)))
    ax.set_xticklabels([f"{p}\nmask {r:g}\n{pol}" for p, r, pol in groups], fontsize=8)
    ax.set_ylabel("speed-up over full computation")
    dev = rows[0]["device"] if rows else "cpu"
    ax.set_title(f"temporal reuse x mask-aware reuse ({dev}, {rows[0]['dtype'] if rows else ''})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="*", default=["bench"],
                    help="model presets (bench: flux_fill; klein-bench, flux-cn-bench; tiny for a quick check)")
    ap.add_argument("--ratios", type=float, nargs="*", default=[0.2])
    ap.add_argument("--steps", type=int, default=10, help="10: a 60 %% step mask computes exactly 6 steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.6, help="the step mask's computed fraction of the steps")
    ap.add_argument("--threshold", type=float, default=0.1, help="fbcache / taylorseer residual threshold")
    ap.add_argument("--controls", default="auto",
                    help="CONTROLS of every request: auto (flux_controlnet presets: one canny at 0.8; others none), "
                         "none, or a JSON list")
    ap.add_argument("--negative-prompt", default=None, help="NEGATIVE_PROMPT of every request (true CFG where the "
                    "family takes it: its negative call reuses too; guided requests run uncached)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", type=Path, default=None, help="default: results/temporal.json (temporal_<gpu>.json)")
    args = ap.parse_args(argv)
    for p in args.presets:
        preset_family(p)  # an unknown preset fails here, before any model is built
    t0 = time.time()
    rows = []
    for p in args.presets:
        rows += run_preset(p, args.ratios, args.steps, args.reps, args.fraction, args.threshold, args.device,
                           args.dtype, args.controls, args.negative_prompt)
    hw = rows[0]["device"] if rows else "cpu"
    out = args.out or RESULTS / ("temporal.json" if hw == "cpu" else f"temporal_{hw}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "presets": args.presets,
            "steps": args.steps, "reps": args.reps, "fraction": args.fraction, "threshold": args.threshold,
            "negative_prompt": args.negative_prompt,
            "device": hw, "dtype": rows[0]["dtype"] if rows else None, "loadavg_end": loadavg(),
            "gpu": torch.cuda.get_device_name() if hw != "cpu" else None}
    summ = summary(rows, args.fraction)
    out.write_text(json.dumps({"meta": meta, "summary": summ, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    for s in summ:
        print(json.dumps(s))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
