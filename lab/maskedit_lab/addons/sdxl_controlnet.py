"""The SDXL ControlNet section of ``make bench-addons`` (``bench_addons --sdxl-controlnet``): the mask-aware, cached
ControlNet on the UNet family (``maskedit.cache.controlnet`` over ``UNetCacheHooks``) against the full controlled
path, and the in-process ControlNet's cost over the base edit, side by side in one run on one model (``sdxl-bench``
by default: SDXL's layout at a sixteenth of the width, 512 px), one canny ControlNet at scale 0.8, through the
service's stages in process (``LocalEditor`` with an activation cache).

The template is registered twice (with the control, and without it for the base rows). Per mask ratio (a box), four
requests with the same seed run interleaved rep by rep (the shared host's drift hits all alike; the first round
warms up), medians of the rest:
  full         controlled, uncached: the ControlNet and the UNet compute every token
  hit          controlled, a cache hit: both compute the masked tokens' transformer rows
  base         no control, uncached (the base edit)
  base-hit     no control, a cache hit
Rows (case ``sdxl-controlnet-mask``, one per ratio): the hit's denoise / e2e speed-up over ``full``, SSIM / PSNR of
its image against ``full``'s (whole image and in the mask), the ControlNet's share of the denoise time
(``DenoiseJob.control_s``) in each, and the ControlNet's overhead over the base edit, uncached and on a hit.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from maskedit import samples
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.families.unet_inpaint.cache import UNetCacheHooks
from maskedit.imaging import encode_png
from maskedit.local import LocalEditor
from maskedit.settings import load_settings

from ..harness.edit_quality import loadavg, quality, rgb

CASE = "sdxl-controlnet-mask"
CONTROLS = [{"name": "canny", "scale": 0.8}]
RATIOS = (0.1, 0.2, 0.5)
GUIDANCE = 7.5
PROMPT = "a hat"
ORDER = ("full", "hit", "base", "base-hit")


def measure(model_dir: Path, steps: int, reps: int, tmp: Path, ratios=RATIOS, cost=None) -> tuple[list[dict], dict]:
    """``cost``: the planner's ``CostModel`` (the preset's calibrated profile, as a server loads it)."""
    s = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": "cpu"})
    size = s.resolution
    png = lambda a: encode_png(np.asarray(a))  # noqa: E731
    tpl, ctl = png(samples.template(size, size, seed=1)), [png(samples.template(size, size, seed=7))]
    store = ActivationStore(tmp / "mem", tmp / "disk", 4 << 30, 4 << 30)
    ed = LocalEditor(s, cache=lambda t: CacheRuntime(UNetCacheHooks.of(t), store, cost), store=store)
    loads, rows = [loadavg()], []
    controlled = dict(controls=CONTROLS, control_images=ctl)
    try:
        empty = png(np.zeros((size, size), np.uint8))
        for kw in (controlled, {}):  # the template's entries: with the control (and its ControlNet's), without
            _, _, reg = ed.edit(tpl, empty, PROMPT, register=True, steps=steps, guidance=GUIDANCE, **kw)
            assert reg.cache.status == "record", reg.cache.status
        ed.runner.cache.flush()
        for ratio in ratios:
            m = samples.mask(size, size, ratio, "box", seed=3)
            got: dict = {c: [] for c in ORDER}
            for i in range(reps + 1):  # the first round warms up
                for case in ORDER:
                    t0 = time.perf_counter()
                    out, _, job = ed.edit(tpl, png(m), PROMPT, seed=5, steps=steps, guidance=GUIDANCE,
                                          use_cache=case.endswith("hit"), **(controlled if case in ("full", "hit")
                                                                             else {}))
                    e2e = time.perf_counter() - t0
                    if case.endswith("hit"):
                        assert job.cache.status == "hit", (case, job.cache.status)
                    if case == "hit":
                        assert [c.status for c in job.control_cache] == ["hit"], job.control_cache
                        computed = int(job.cache.idx_c.numel()) / job.inputs.latents.shape[0]
                    if i:
                        got[case].append((e2e, job.finished_at - job.started_at, job.control_s, out))
                    loads.append(loadavg())
            med = {c: {k: statistics.median(x[j] for x in got[c]) for j, k in enumerate(("e2e", "denoise", "cn"))}
                   for c in got}
            full, hit, base, base_hit = (med[c] for c in ORDER)
            rows.append({
                "case": CASE, "mask_ratio": ratio, "computed_tokens": round(computed, 3), "preset": None,
                "device": "cpu", "dtype": "float32", "steps": steps, "controls": CONTROLS,
                "latency_s": round(hit["e2e"], 4), "full_latency_s": round(full["e2e"], 4),
                "denoise_s": round(hit["denoise"], 4), "full_denoise_s": round(full["denoise"], 4),
                "speedup": round(full["denoise"] / hit["denoise"], 3),
                # per round (the two ran back to back): steadier than the ratio of medians on a shared host
                "speedup_paired": round(statistics.median(f[1] / h[1] for f, h in zip(got["full"], got["hit"])), 3),
                "e2e_speedup": round(full["e2e"] / hit["e2e"], 3),
                **quality(rgb(got["full"][0][3]), rgb(got["hit"][0][3]), np.asarray(m) > 127),
                # the ControlNet's part of the denoise loop (its calls' wall time) and its cost over the base edit
                "controlnet_s": round(hit["cn"], 4), "full_controlnet_s": round(full["cn"], 4),
                "controlnet_share": round(hit["cn"] / hit["denoise"], 3),
                "full_controlnet_share": round(full["cn"] / full["denoise"], 3),
                "base_denoise_s": round(base["denoise"], 4), "base_hit_denoise_s": round(base_hit["denoise"], 4),
                "controlnet_overhead": round(full["denoise"] / base["denoise"] - 1, 4),
                "controlnet_overhead_hit": round(hit["denoise"] / base_hit["denoise"] - 1, 4),
                "controlnet_overhead_e2e": round(full["e2e"] / base["e2e"] - 1, 4),
                "denoise_runs_s": {c: [round(x[1], 4) for x in got[c]] for c in got},
                "latencies_s": {c: [round(x[0], 4) for x in got[c]] for c in got},
            })
    finally:
        ed.close()
    return rows, {"start": loads[0], "max": max(loads), "end": loads[-1]}


def run(preset: str = "sdxl-bench", steps: int = 4, reps: int = 3, ratios=RATIOS,
        model_dir: Path | None = None) -> tuple[list[dict], dict]:
    """The section's rows and its meta (for ``addons.json``'s ``meta[CASE]``)."""
    from maskedit.build_model import build
    from maskedit.cache.cost_model import CostModel
    from maskedit.families import family_for

    from .. import REPO_ROOT

    profile = REPO_ROOT / "perf_profiles" / f"cost_model_{preset}.json"  # calibrated on this host (docs/unet.md)
    cost = CostModel.load_file(profile) if profile.exists() else CostModel.fallback()
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            model_dir = Path(build(Path(tmp) / "model", preset))
        if not (Path(model_dir) / "controlnets" / "canny").is_dir():
            family_for(model_dir).build_controlnets(Path(model_dir) / "controlnets")
        rows, load = measure(Path(model_dir), steps, reps, Path(tmp), ratios, cost)
    for r in rows:
        r["preset"] = preset
    meta = {"preset": preset, "steps": steps, "reps": reps, "device": "cpu", "dtype": "float32",
            "threads": torch.get_num_threads(), "cores": os.cpu_count(), "load_avg": load,
            "cost_profile": profile.name if profile.exists() else "FLOP fallback",
            "speedup": "full_denoise_s / denoise_s (the step loop; medians); speedup_paired: median over rounds of "
                       "full / hit; e2e_speedup: whole edits",
            "controlnet_overhead": "full_denoise_s / base_denoise_s - 1 (uncached); _hit: on cache hits"}
    at = next((r for r in rows if r["mask_ratio"] == 0.2), None)
    if at is not None:  # the target: >= 1.5x over the full ControlNet path at 0.2 with SSIM >= 0.98
        meta["targets_met"] = {"speedup at mask 0.2 >= 1.5x": at["speedup"] >= 1.5,
                               "SSIM at mask 0.2 >= 0.98": at["ssim"] >= 0.98,
                               "SSIM in the mask's box at 0.2 >= 0.98": at["ssim_mask_box"] >= 0.98}
    return rows, meta


def merge(addons: dict, rows: list[dict], meta: dict) -> dict:
    """``addons.json`` with this run's rows replaced (same preset and mask ratio), every other row (LoRA, Flux
    ControlNet, other ratios) kept."""
    key = lambda r: (r.get("case"), r.get("preset"), r.get("mask_ratio"))  # noqa: E731
    fresh = {key(r) for r in rows}
    addons["rows"] = [r for r in addons.get("rows", []) if key(r) not in fresh] + rows
    addons.setdefault("meta", {})[CASE] = meta
    return addons


def section(out: Path, preset: str, steps: int, reps: int, ratios=RATIOS) -> None:
    """Run the section; its rows merged into ``out`` (``addons.json``), its own JSON and plot beside it
    (``addons_sdxl_controlnet.json`` / ``.png``)."""
    import json

    rows, meta = run(preset, steps, reps, ratios)
    addons = merge(json.loads(out.read_text()) if out.exists() else {"meta": {}, "rows": []}, rows, meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(addons, indent=1) + "\n")
    own = out.with_name("addons_sdxl_controlnet.json")
    own.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    load = meta["load_avg"]
    plot(rows, own.with_suffix(".png"), f"Mask-aware SDXL ControlNet (canny 0.8), {preset}, {steps} steps, "
         f"CPU float32, load {load['start']}-{load['max']}")
    print(markdown_table(rows))
    print(f"merged {len(rows)} {CASE} rows into {out}; wrote {own} and {own.with_suffix('.png')} (load {load})")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = np.arange(len(rows))
    w = 0.2
    for k, (key, label) in enumerate((("base_denoise_s", "base edit (no control)"),
                                      ("full_denoise_s", "+ ControlNet, full"),
                                      ("base_hit_denoise_s", "base edit, cache hit"),
                                      ("denoise_s", "+ ControlNet, cache hit"))):
        ax.bar(x + (k - 1.5) * w, [r[key] for r in rows], w, label=label)
    for i, r in enumerate(rows):
        ax.text(i + 1.5 * w, r["denoise_s"], f"{r['speedup']:.2f}x\nSSIM {r['ssim_mask_box']:.3f}", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(x, [f"mask {r['mask_ratio']}" for r in rows])
    ax.set_ylabel("denoise seconds per edit (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| mask ratio | tokens computed | full (s) | hit (s) | speed-up (paired) | e2e speed-up | SSIM / PSNR in mask "
             "| ControlNet share full / hit | ControlNet overhead full / hit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mask_ratio']} | {r['computed_tokens']} | {r['full_denoise_s']:.2f} | {r['denoise_s']:.2f} "
                     f"| {r['speedup']:.2f}x ({r.get('speedup_paired', float('nan')):.2f}x) | {r['e2e_speedup']:.2f}x | {r['ssim_mask_box']:.4f} / "
                     f"{r['psnr_mask_db']:.1f} dB | {r['full_controlnet_share']:.0%} / {r['controlnet_share']:.0%} | "
                     f"{r['controlnet_overhead']:+.0%} / {r['controlnet_overhead_hit']:+.0%} |")
    return "\n".join(lines)
