"""How approximate ``MASKEDIT_CACHE_LORA_BASE_REUSE`` is: an adapter request reading its template's no-adapter
recording for its unmasked tokens, against the exact path (the template recorded under the request's own adapter
set, then the same hit), side by side in one run.

For each preset, adapter set and mask ratio (one template, a mask covering that fraction of the image tokens):
  exact      the hit on the entry recorded under the adapter set (what serving does by default)
  reuse      the hit on the entry recorded without adapters (the opt-in)
  full       no cache, the adapter set applied everywhere (the reference both approximate for a new mask)
  no_lora    the hit without adapters: how far the adapters themselves move the image (for scale)
Fidelity is SSIM / PSNR of the decoded images against ``exact`` (and against ``full``), over the whole image and
the masked region (what the served image keeps: the unmasked region is composited from the template). Also the
seconds the template pass under the adapter set takes (what reuse saves, once per template and set).

    # tiny and bench presets -> perf_profiles/results/lora_base_reuse.json
    python -m maskedit_lab.addons.lora_base_reuse
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from maskedit.adapters.build import write_library
from maskedit.decode import Decoder
from maskedit.families import preset_family
from maskedit.local import run_job

from .. import REPO_ROOT
from ..engine.bench_engine import fidelity
from ..harness.in_process import Harness

RESULTS = REPO_ROOT / "perf_profiles" / "results"
RATIOS = (0.1, 0.2, 0.5)
SETS = {"attn-r4": [("attn-r4", 1.0)], "attn-mlp-r16": [("attn-mlp-r16", 1.0)],
        "attn-mlp-r8+attn-r64": [("attn-mlp-r8", 0.7), ("attn-r64", -0.4)]}


def _loras(pairs) -> str:
    return json.dumps([{"name": n, "scale": w} for n, w in pairs])


def _run(h: Harness, x, **engine_kw):
    eng, rt = h.engine("planner", **engine_kw)
    try:
        t0 = time.perf_counter()
        job = run_job(eng, x)
        dt = time.perf_counter() - t0
        if rt is not None:
            rt.flush()
        return job, dt
    finally:
        eng.shutdown()
        if rt is not None:
            rt.close()


def _scores(ref: np.ndarray, img: np.ndarray, masked: np.ndarray, prefix: str) -> dict:
    whole = fidelity(ref, img, masked)  # its "unmasked" keys are the region passed: here the masked one
    return {f"{prefix}_ssim": whole["ssim"], f"{prefix}_psnr": whole["psnr"],
            f"{prefix}_ssim_masked": whole.get("ssim_unmasked"), f"{prefix}_psnr_masked": whole.get("psnr_unmasked")}


def _latent_errors(x, exact, reuse, no_lora) -> dict:
    """Mean absolute latent error over the masked tokens (the images' SSIM hides small latent moves on a random
    VAE): of reuse, and of leaving the adapters out altogether, against the exact path."""
    m = np.asarray(x.token_mask, bool)
    e = exact.result()[m]
    return {"reuse_latent_err_masked": float(np.abs(reuse.result()[m] - e).mean()),
            "no_lora_latent_err_masked": float(np.abs(no_lora.result()[m] - e).mean())}


def run_preset(preset: str, ratios=RATIOS, sets=SETS, steps: int | None = None,
               models: Path | None = None) -> list[dict]:
    model_dir = Path(models or REPO_ROOT / "models") / preset_family(preset).dir_name(preset)
    lib = Path(tempfile.mkdtemp(prefix="maskedit-loras-"))
    os.environ["MASKEDIT_LORA_DIR"] = str(lib)
    try:
        return _measure(preset, model_dir, lib, ratios, sets, steps)
    finally:
        shutil.rmtree(lib, ignore_errors=True)


def _measure(preset: str, model_dir: Path, lib: Path, ratios, sets, steps) -> list[dict]:
    h = Harness.create(model_dir=model_dir, preset=preset, steps=steps)
    write_library(model_dir, h.runner.family, h.runner.transformer, out=lib)  # seeded: the tiny model's library
    dec = Decoder(h.settings)
    w, hh = h.template.size
    image = lambda job: np.asarray(dec.decode_latents(job.result(), w, hh).convert("RGB"))  # noqa: E731
    base = h.register()  # the template without adapters: what reuse reads
    rows = []
    for set_name, pairs in sets.items():
        lo = _loras(pairs)
        cases = []
        for ratio in ratios:  # reuse first: the request's own entry does not exist yet, as for a first request
            mask = h.mask(ratio, seed=int(ratio * 100))
            x = h.inputs(mask, seed=1, loras=lo)
            reuse, reuse_s = _run(h, x, lora_base_reuse=True)
            cases.append((ratio, mask, x, reuse, reuse_s))
        reg, reg_s = _run(h, h.inputs(np.zeros((hh, w), np.uint8), register=True, loras=lo))
        assert reg.cache.status == "record"
        for ratio, mask, x, reuse, reuse_s in cases:
            masked = mask > 127
            exact, exact_s = _run(h, x)
            full, full_s = _run(h, replace(x, cache_key=None))
            no_lora, _ = _run(h, replace(x, loras=(), cache_key=base.cache_key))
            assert exact.cache.status == "hit" and not exact.cache.base_reuse
            assert reuse.cache.status == "hit" and reuse.cache.base_reuse
            ref, ref_full = image(exact), image(full)
            row = {"preset": preset, "device": h.settings.torch_device, "dtype": h.settings.dtype,
                   "adapters": set_name, "loras": [list(p) for p in pairs],
                   "mask_ratio": ratio, "masked_tokens": int(np.asarray(x.token_mask).sum()),
                   "tokens": int(len(x.token_mask)), "steps": h.steps, "template_pass_s": round(reg_s, 3),
                   "exact_hit_s": round(exact_s, 3), "reuse_hit_s": round(reuse_s, 3), "full_s": round(full_s, 3),
                   **_latent_errors(x, exact, reuse, no_lora)}
            row.update(_scores(ref, image(reuse), masked, "reuse_vs_exact"))
            row.update(_scores(ref, image(no_lora), masked, "no_lora_vs_exact"))
            row.update(_scores(ref_full, image(reuse), masked, "reuse_vs_full"))
            row.update(_scores(ref_full, ref, masked, "exact_vs_full"))
            rows.append(row)
            print(f"{preset} {set_name} ratio {ratio}: reuse vs exact SSIM {row['reuse_vs_exact_ssim']:.4f} "
                  f"(masked {row['reuse_vs_exact_ssim_masked']:.4f}), PSNR {row['reuse_vs_exact_psnr']:.1f} dB; "
                  f"no adapters vs exact SSIM masked {row['no_lora_vs_exact_ssim_masked']:.4f}; latent error "
                  f"{row['reuse_latent_err_masked']:.4f} vs {row['no_lora_latent_err_masked']:.4f}", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["preset"] for r in rows})
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for name in dict.fromkeys(r["adapters"] for r in rows):
            rs = [r for r in rows if r["preset"] == preset and r["adapters"] == name]
            xs = [r["mask_ratio"] for r in rs]
            line, = ax.plot(xs, [r["reuse_vs_exact_ssim_masked"] for r in rs], marker="o", label=f"reuse {name}")
            ax.plot(xs, [r["no_lora_vs_exact_ssim_masked"] for r in rs], marker="x", linestyle=":",
                    color=line.get_color(), label=f"no adapters {name}")
        ax.set_title(f"{preset}: SSIM of the masked region against the exact path")
        ax.set_xlabel("mask ratio")
        ax.set_ylabel("SSIM")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "bench"])
    ap.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--models", type=Path, default=None, help="directory of the preset models (default models/)")
    ap.add_argument("--out", type=Path, default=RESULTS / "lora_base_reuse.json")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = [r for p in a.presets for r in run_preset(p, tuple(a.ratios), steps=a.steps, models=a.models)]
    out = {"device": rows[0]["device"], "dtype": rows[0]["dtype"], "host": platform.node(),
           "threads": torch.get_num_threads(), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
