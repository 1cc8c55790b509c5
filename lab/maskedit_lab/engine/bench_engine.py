"""`maskedit-bench-engine`: mask-aware caching against full computation, side by side in one run.

On the benchmark-size model (~18M transformer parameters, 1024 image tokens), for each mask ratio (fraction
of image tokens edited) it times the denoising of one image with:
  full       stock computation (cache off)
  naive      every block from the cache (y mode), rows loaded inside the block (no overlap)
  overlap    every block from the cache (y mode), rows loaded by the loader thread (the strawman pipeline)
  planner_y  Algorithm 1 choosing full / y per block, loader thread
  planner    Algorithm 1 choosing full / y / kv per block, loader thread
  noctx      masked tokens computed without the unmasked context (the naive shortcut; a fidelity lower bound)
and reports speedup over full, the FLOP-model ideal speedup of the plan used, two kernel ceilings (the speedup
if every GEMM/attention ran at the speed the stock kernels reach at its shape here: with cache-hot weights, and
with weights streamed from memory as in a real step; see ``kernel_ceiling.py``), and fidelity against full
(SSIM/PSNR of the decoded images, whole image and unmasked region). Writes JSON and a plot.

A second table puts PADDING_MASK_CROP side by side with the uncropped edit on a large template (2048² with a 10 %
box mask by default: ``--crop-template``, ``--crop-ratio``, ``--crop-pad``; 0 leaves it out): both at the model's
size, in full and from the cache, with the tokens each computes and the model pixels per template pixel each edits
the masked region at (the crop's detail).

    maskedit-bench-engine                                              # CPU, bench preset -> engine.json
    maskedit-bench-engine --preset flux-dev --device cuda --dtype bfloat16 --steps 8   # -> engine_<gpu>.json

On a GPU every time is the device's (requests finish after a synchronize; kernel ceilings from CUDA events) and
each row also reports ``gpu_idle``: the fraction of one extra run of that mode during which no kernel ran on the
GPU (torch profiler; launch gaps and waits for cache loads alike).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from maskedit import samples
from maskedit.cache.cost_model import device_slug
from maskedit.decode import Decoder
from maskedit.local import denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit_common.cost_model import CostModel
from maskedit_common.flops import edges, ideal_speedup

from .. import REPO_ROOT
from ..harness.in_process import Harness, png
from .kernel_ceiling import KernelTimer

RATIOS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
MODES = {  # name -> (cache policy, loader overlap)
    "full": ("off", True), "naive": ("all_y", False), "overlap": ("all_y", True),
    "planner_y": ("planner_y", True), "planner": ("planner", True), "noctx": ("noctx", True),
}
RESULTS = REPO_ROOT / "perf_profiles" / "results"


def fidelity(ref: np.ndarray, img: np.ndarray, keep: np.ndarray) -> dict:
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    ssim, smap = structural_similarity(ref, img, channel_axis=2, data_range=255, full=True)
    out = {"ssim": float(ssim), "psnr": float(peak_signal_noise_ratio(ref, img, data_range=255))}
    if keep.any():
        mse = float(((ref[keep].astype(np.float64) - img[keep]) ** 2).mean())
        out["ssim_unmasked"] = float(smap[keep].mean())
        out["psnr_unmasked"] = float("inf") if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))
    return out


def gpu_idle(fn, device) -> float | None:
    """Fraction of ``fn()``'s span during which no CUDA kernel or copy ran (torch profiler); None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return None
    busy, (lo, hi) = 0.0, spans[0]
    first = lo
    for a, b in spans[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return max(0.0, 1.0 - busy / max(1e-9, hi - first))


def run(ratios=RATIOS, modes=tuple(MODES), reps: int = 3, steps: int | None = None, model_dir=None,
        preset: str = "bench", device: str | None = None, dtype: str | None = None,
        budget_bytes: int = 8 << 30) -> list[dict]:
    h = Harness.create(model_dir, preset=preset, steps=steps, device=device, dtype=dtype, budget_bytes=budget_bytes)
    profile = h.settings.cost_profile_for(device_slug(h.runner.device))
    h.cost = CostModel.load_file(profile) if profile.exists() else CostModel.fallback()
    h.register()
    decoder = Decoder(h.settings)
    engines = {m: h.engine(*MODES[m]) for m in modes}
    cfg = h.runner.transformer.config
    unet = (h.hooks.layout == "per_block")  # SD 2 / SDXL: the rest of the UNet is measured, the blocks added per plan (unet_costs)
    if unet:
        from .unet_costs import UNetStepCosts, timers

        n_blocks = len(h.hooks.blocks)
        unet_costs = UNetStepCosts.measure(h.runner, h.inputs(h.mask(0.0), register=True), h.hooks)
        kernels, streamed = timers(h.runner.device, h.runner.dtype)
    else:
        dim = cfg.num_attention_heads * cfg.attention_head_dim
        n_blocks, n_dual = len(h.hooks.blocks), h.hooks.n_dual  # the hooks' blocks: dual-stream, then single
        io = edges(cfg)  # x_embedder / proj_out widths: they run on every token in every mode
        kernels, streamed = KernelTimer.hot_and_streamed(cfg.num_attention_heads, h.runner.device, h.runner.dtype)
    rows = []
    try:
        for ratio in tqdm(ratios, desc="mask ratios"):
            mask = h.mask(ratio, seed=int(ratio * 1000))
            x = h.inputs(mask)
            # n: the rows an entry holds per block, the image tokens and any reference tokens (cached like them)
            n, text = h.hooks.cache_mask(x).size, x.prompt_embeds.shape[0]
            text = h.runner.family.flop_text(text, n)  # tokens every mode computes in full
            times = {m: [] for m in modes}
            jobs = {}
            for _ in range(reps):  # interleaved, so drift in machine speed hits every mode alike
                for m in modes:
                    job = run_job(engines[m][0], x)
                    times[m].append(job.finished_at - job.started_at)
                    jobs[m] = job
            keep = np.kron((~np.asarray(x.token_mask, bool)).reshape(x.model_h // h.pre.patch, -1),
                           np.ones((h.pre.patch, h.pre.patch), bool)).astype(bool)
            idle = {m: gpu_idle(lambda: run_job(engines[m][0], x), h.runner.device) for m in modes}
            images = {m: np.asarray(decoder.decode_latents(j.result(), x.model_w, x.model_h)) for m, j in jobs.items()}
            full_s = statistics.median(times["full"]) if "full" in times else None
            for m in modes:
                jc = jobs[m].cache
                plan_modes = jc.modes if jc is not None and jc.status == "hit" else ["full"] * n_blocks
                c = int(jc.idx_c.numel()) if jc is not None and jc.idx_c is not None else n
                computed = np.isin(np.arange(n), jc.idx_c.cpu().numpy()) if c < n else None
                d = statistics.median(times[m])
                row = {
                    "mask_ratio": ratio, "mode": m, "denoise_s": round(d, 5), "steps": h.steps,
                    "speedup": round(full_s / d, 3) if full_s else None,
                    "ideal_speedup": round(unet_costs.ideal_speedup(plan_modes, computed) if unet else
                                           ideal_speedup(plan_modes, n_dual, n, c, text, dim, **io), 3),
                    "computed_tokens": c, "tokens": n, "block_modes": jc.info()["block_modes"] if jc else "",
                    "cache": jc.status if jc else "off", "load_s": round(jc.load_s, 5) if jc else 0.0,
                    "device": device_slug(h.runner.device), "dtype": h.settings.dtype,
                    "gpu_idle": None if idle[m] is None else round(idle[m], 4),
                    **{k: (round(v, 4) if np.isfinite(v) else None)  # identical images: PSNR is infinite
                       for k, v in fidelity(images.get("full", images[m]), images[m], keep).items()},
                }
                row["efficiency"] = round(row["speedup"] / row["ideal_speedup"], 3) if row["speedup"] else None
                if unet:  # ResNets, samplers, norms and projections: full computation in every mode
                    row.update(unet_costs.rest_share())
                for name, timer in (("kernel_ceiling", kernels), ("streamed_ceiling", streamed)):
                    row[name] = round(unet_costs.ceiling_speedup(plan_modes, computed, timer) if unet else
                                      timer.ceiling_speedup(plan_modes, n_dual, n, c, text, dim, **io), 3)
                    row["of_" + name] = round(row["speedup"] / row[name], 3) if row["speedup"] else None
                rows.append(row)
    finally:
        for eng, rt in engines.values():
            eng.shutdown()
            if rt is not None:
                rt.close()
    return rows


def crop_rows(h: Harness, side: int = 2048, ratio: float = 0.1, pad: int = 32, reps: int = 3) -> list[dict]:
    """PADDING_MASK_CROP against the uncropped edit of one large template (a ``ratio`` box mask), both registered
    first: ``full`` (cache off) and ``planner`` (a hit) each. The crop runs at the model's size like the whole
    template, so its gain is detail (model pixels per template pixel in the mask) and its cost the larger share of
    its tokens the mask covers (what a hit computes)."""
    tpl, mask = samples.template(side, side, seed=5), samples.mask(side, side, ratio, "box", seed=5)

    def inputs(crop: bool, register: bool = False, m=mask):
        params = parse_params(h.settings, "a red dress", steps=h.steps, register=register,
                              padding_mask_crop=pad if crop else None)
        return h.pre(png(tpl), png(m), params)

    eng, rt = h.engine("planner")
    try:  # the template run of each: the whole template (empty mask), the crop (its box comes from the mask)
        run_job(eng, denoise_inputs(inputs(False, True, np.zeros_like(mask))))
        run_job(eng, denoise_inputs(inputs(True, True)))
        rt.flush(timeout=1800)
    finally:
        eng.shutdown()
        rt.close()
    engines = {m: h.engine(MODES[m][0]) for m in ("full", "planner")}
    rows, times, jobs = [], {}, {}
    try:
        prepared = {v: inputs(v == "crop") for v in ("whole", "crop")}
        for _ in range(reps):  # interleaved, as the main table
            for v, p in prepared.items():
                for m, (e, _) in engines.items():
                    job = jobs[(v, m)] = run_job(e, denoise_inputs(p))
                    times.setdefault((v, m), []).append(job.finished_at - job.started_at)
    finally:
        for e, r in engines.values():
            e.shutdown()
            if r is not None:
                r.close()
    base = statistics.median(times[("whole", "full")])
    for (v, m), job in jobs.items():
        p, jc = prepared[v], job.cache
        width = (p.crop[2] - p.crop[0]) if p.crop else side
        d = statistics.median(times[(v, m)])
        rows.append({
            "case": "padding_mask_crop", "variant": v, "mode": m, "template": side, "mask_area": ratio,
            "pad": pad if v == "crop" else None, "crop": list(p.crop) if p.crop else None, "denoise_s": round(d, 5),
            "speedup_vs_whole_full": round(base / d, 3), "tokens": int(p.token_mask.size),
            "mask_tokens": int(p.token_mask.sum()), "computed_tokens": int(jc.idx_c.numel())
            if jc is not None and jc.idx_c is not None else int(p.token_mask.size),
            "cache": jc.status if jc else "off", "model_px_per_template_px": round(p.model_w / width, 3),
            "steps": h.steps, "device": device_slug(h.runner.device), "dtype": h.settings.dtype})
    return rows


def crop_table(rows: list[dict]) -> str:
    lines = ["| template | variant | mode | denoise s | vs whole full | tokens | mask tokens | computed | cache "
             "| model px / template px |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['template']}² {r['mask_area']:.0%} | {r['variant']}"
                     f"{'' if r['pad'] is None else ' pad ' + str(r['pad'])} | {r['mode']} | {r['denoise_s']:.3f} | "
                     f"{r['speedup_vs_whole_full']:.2f} | {r['tokens']} | {r['mask_tokens']} | {r['computed_tokens']}"
                     f" | {r['cache']} | {r['model_px_per_template_px']:.2f} |")
    return "\n".join(lines)


def plot_crop(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['variant']} {r['mode']}" for r in rows]
    bars = ax.bar(labels, [r["denoise_s"] for r in rows], color=["C0" if r["variant"] == "whole" else "C1" for r in rows])
    for b, r in zip(bars, rows):
        ax.annotate(f"{r['computed_tokens']} tok\n{r['model_px_per_template_px']:.2f} px/px",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    t = rows[0]
    ax.margins(y=0.2)
    ax.set(ylabel="denoise s / image", title=f"padding_mask_crop on a {t['template']}² template, "
           f"{t['mask_area']:.0%} mask ({t['device']}, {t['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == m]
        xs = [r["mask_ratio"] for r in rs]
        ax1.plot(xs, [r["speedup"] for r in rs], marker="o", label=m)
        if m in ("planner", "planner_y"):
            ax1.plot(xs, [r["ideal_speedup"] for r in rs], linestyle=":", label=f"{m} FLOP ideal")
            if "kernel_ceiling" in rs[0]:
                ax1.plot(xs, [r["kernel_ceiling"] for r in rs], linestyle="--", label=f"{m} kernel ceiling")
            if "streamed_ceiling" in rs[0]:
                ax1.plot(xs, [r["streamed_ceiling"] for r in rs], linestyle="-.",
                         label=f"{m} kernel ceiling, weights streamed")
        if m != "full":
            ax2.plot(xs, [r["ssim"] for r in rs], marker="o", label=f"{m} (whole)")
    ax1.set(xlabel="mask ratio (edited tokens / all)", ylabel="speedup over full", title="denoise latency per image")
    ax1.set_yscale("log")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set(xlabel="mask ratio", ylabel="SSIM vs full computation", title="fidelity of the decoded image")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(rows: list[dict]) -> str:
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["| mask ratio | mode | denoise s/image | speedup | FLOP ideal | of ideal | kernel ceiling | of ceiling "
             "| streamed ceiling | of streamed | SSIM | PSNR dB | SSIM unmasked | PSNR unmasked | blocks (F/Y/K/N) |",
             "|" + "---|" * 15]
    for r in rows:
        lines.append(f"| {r['mask_ratio']:.2f} | {r['mode']} | {r['denoise_s']:.3f} | {fmt(r['speedup'], '.2f')} | "
                     f"{r['ideal_speedup']:.2f} | {fmt(r['efficiency'], '.0%')} | {fmt(r.get('kernel_ceiling'), '.2f')} | "
                     f"{fmt(r.get('of_kernel_ceiling'), '.0%')} | {fmt(r.get('streamed_ceiling'), '.2f')} | "
                     f"{fmt(r.get('of_streamed_ceiling'), '.0%')} | {r['ssim']:.3f} | {fmt(r['psnr'], '.1f')} | "
                     f"{fmt(r.get('ssim_unmasked'), '.3f')} | {fmt(r.get('psnr_unmasked'), '.1f')} | "
                     f"{r['block_modes'] or 'all F'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="default: the model's (8 for the bench preset)")
    ap.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS))
    ap.add_argument("--preset", default="bench", help="model preset (bench; flux-dev: FLUX.1-Fill-dev size, GPU; "
                    "sd2-bench / sdxl-bench: SD 2 / SDXL inpainting layouts on the CPU; sdxl: SDXL's real size, GPU)")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: models/<preset's directory> (built if "
                    "missing)")
    ap.add_argument("--device", default=None, help="cpu, cuda (default: MASKEDIT_DEVICE or auto)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: MASKEDIT_DTYPE or float32)")
    ap.add_argument("--budget-gib", type=float, default=8.0, help="activation bytes recorded per template (Y first, "
                    "then keys/values); FLUX.1 size at 8 steps needs ~11.5 GiB for Y in every block, twice that for KV")
    ap.add_argument("--out", type=Path, default=None, help="default: results/engine.json, engine_<gpu>.json on a GPU")
    ap.add_argument("--crop-template", type=int, default=2048, help="side of the PADDING_MASK_CROP table's template "
                    "(0: no such table)")
    ap.add_argument("--crop-ratio", type=float, default=0.1, help="its mask's share of the template")
    ap.add_argument("--crop-pad", type=int, default=32, help="its PADDING_MASK_CROP")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = run(args.ratios, reps=args.reps, steps=args.steps, model_dir=args.model_dir, preset=args.preset,
               device=args.device, dtype=args.dtype, budget_bytes=int(args.budget_gib * (1 << 30)))
    hw = rows[0]["device"] if rows else "cpu"
    name = "engine" if args.preset in ("bench", "flux-dev", "flux-width") else f"engine_{args.preset}"
    out = args.out or RESULTS / (f"{name}.json" if hw == "cpu" else f"{name}_{hw}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "preset": args.preset,
            "device": hw, "dtype": rows[0]["dtype"] if rows else None,
            "gpu": torch.cuda.get_device_name() if hw != "cpu" else None}

    def save(cropped: list) -> None:
        out.write_text(json.dumps({"meta": meta, "rows": rows, "crop_rows": cropped}, indent=1))

    save([])  # before the crop table too: a lent GPU's time can run out during it, and the rows must survive that
    plot(rows, out.with_suffix(".png"))
    print(markdown_table(rows), flush=True)
    cropped = []
    if args.crop_template:
        h = Harness.create(args.model_dir, preset=args.preset, steps=args.steps, device=args.device, dtype=args.dtype,
                           budget_bytes=int(args.budget_gib * (1 << 30)))
        cropped = crop_rows(h, args.crop_template, args.crop_ratio, args.crop_pad, args.reps)
        meta["seconds"] = round(time.time() - t0, 1)
        save(cropped)
    if cropped:
        plot_crop(cropped, out.with_name(out.stem + "_crop.png"))
        print(crop_table(cropped))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
