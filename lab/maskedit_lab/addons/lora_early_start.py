"""`python -m maskedit_lab.addons.lora_early_start`: SwiftDiffusion's early start against the exact path, and what each
tier of the adapter cache costs to load from.

Early start (``MASKEDIT_LORA_EARLY_START=1``) lets a request denoise before its adapters are loaded; they apply from
the step boundary after the load ends. Here the load is made to end after step ``k`` (a gated loader: the engine's
own path, ``maskedit.adapters.jobs``), for several ``k``, and the decoded edit is compared with the exact path
(adapters from step 0) by SSIM and PSNR, over the whole image and over the edited (masked) pixels. The row ``k =
steps`` is the request served without its adapters at all: how far the adapters move the image, the scale the
early-start figures are read against. Side by side in one run: the tiers' load times (library file read and
converted; the host tier's converted copy; the device tier) for each adapter of the library.

Writes perf_profiles/results/lora_early_start.json and .png (``--plot-only`` redraws the plot from the JSON)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from maskedit import samples
from maskedit.adapters.library import ResolvedRef
from maskedit.denoise import DenoiseJob
from maskedit.local import LocalEditor, denoise_inputs
from maskedit.params import parse_params
from maskedit.settings import load_settings

from .. import REPO_ROOT
from ..harness.in_process import png

RESULTS = REPO_ROOT / "perf_profiles" / "results"
SETS = {"one": [("attn-mlp-r16", 1.0)], "two": [("attn-mlp-r16", 0.8), ("attn-r64", -0.6)]}


def fidelity(ref: np.ndarray, img: np.ndarray, edited: np.ndarray) -> dict:
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    ssim, smap = structural_similarity(ref, img, channel_axis=2, data_range=255, full=True)
    mse = float(((ref[edited].astype(np.float64) - img[edited]) ** 2).mean())
    return {"ssim": float(ssim), "psnr": float(peak_signal_noise_ratio(ref, img, data_range=255)),
            "ssim_edited": float(smap[edited].mean()),
            "psnr_edited": float("inf") if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))}


def run(ed: LocalEditor, inputs, arrive_after: int | None) -> np.ndarray:
    """Denoise ``inputs`` with its adapters arriving after step ``arrive_after`` (None: loaded beforehand, the exact
    path); returns the latents."""
    rt = ed.runner.adapters
    rt.clear()
    if arrive_after is None:
        rt.resolve(inputs.loras)
    gate, load = threading.Event(), rt._load
    rt._load = lambda ref: (gate.wait(120), load(ref))[1]
    done, errors = threading.Event(), []

    def on_step(j):
        if j.step_index == arrive_after:
            gate.set()
            j.adapter_load.result(120)  # the load ends here: its adapters apply from the next step

    job = DenoiseJob(inputs, on_done=lambda j: done.set(), on_error=lambda j, e: (errors.append(e), done.set()),
                     on_step=on_step if arrive_after is not None else None)
    try:
        ed.engine.submit(job)
        done.wait(600)
    finally:
        gate.set()
        if job.adapter_load is not None:  # a load still running would refill the device tier for the next run
            job.adapter_load.exception(120)
        rt._load = load
    if errors:
        raise errors[0]
    expected = 0 if arrive_after is None else (arrive_after if arrive_after < inputs.steps else None)
    assert job.adapters_from_step == expected, (job.adapters_from_step, expected)
    return job.result()


def tier_times(ed: LocalEditor, names: list[str], repeats: int) -> list[dict]:
    rt, lib = ed.runner.adapters, ed.runner.adapters.library
    rows = []
    for name in names:
        ref = ResolvedRef(name, 1.0, lib.file(name).digest)
        t = {"library": [], "host": [], "device": []}
        for _ in range(repeats):
            for p, _ in rt.host.entries():
                p.unlink()
            rt.clear()
            for tier in ("library", "host", "device"):
                if tier == "host":
                    rt.clear()
                t0 = time.perf_counter()
                a = rt.get(ref)
                t[tier].append(time.perf_counter() - t0)
        rows.append({"adapter": name, "bytes": a.nbytes, "modules": len(a.modules), "ranks": a.ranks,
                     **{f"{k}_ms": round(1000 * statistics.median(v), 3) for k, v in t.items()}})
    return rows


# FLUX.1-Fill-dev's transformer (the ``flux-dev`` preset's config): its adapters are what users bring
FLUX_DEV = {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
            "guidance_embeds": True, "in_channels": 384, "joint_attention_dim": 4096, "num_attention_heads": 24,
            "num_layers": 19, "num_single_layers": 38, "out_channels": 64, "patch_size": 1,
            "pooled_projection_dim": 768}


def wide_tier_times(scratch: Path, repeats: int, rank: int = 16) -> dict:
    """The host tier against the library file for a rank-``rank`` attention + MLP adapter of FLUX.1-Fill-dev's
    transformer in bfloat16 (as served on GPUs): conversion needs only the module tree, so no weights are made."""
    import torch

    from maskedit.adapters import skeleton
    from maskedit.adapters.build import random_lora
    from maskedit.adapters.host_cache import AdapterHostCache, entry_key
    from maskedit.adapters.library import AdapterLibrary
    from maskedit.adapters.runtime import from_library
    from maskedit.families import family_for

    model = scratch / "flux-dev-config"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "FluxFillPipeline",
                                                        "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    (model / "transformer" / "config.json").write_text(json.dumps(FLUX_DEV))
    s = replace(load_settings(), model_dir=model, dtype="bfloat16")
    fam = family_for(model)
    skel = skeleton.denoiser_skeleton(s, fam)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in random_lora(skel, rank, "attn+mlp", 0).items()}
    fam.pipeline_class().save_lora_weights(model / "loras" / "wide", transformer_lora_layers=sd)
    lib = AdapterLibrary(model / "loras")
    ref = ResolvedRef("wide", 1.0, lib.file("wide").digest)
    host = AdapterHostCache(Path(tempfile.mkdtemp(prefix="lora-wide-", dir="/dev/shm")), 8 << 30)  # RAM, as served
    key = entry_key("wide", ref.digest, skeleton.fingerprint(s, fam))
    t = {"library": [], "host_write": [], "host": []}
    threads = torch.get_num_threads()
    # One intra-op thread: on this shared 2-core host torch's threaded copies and reductions over 760 small tensors
    # took 10-30x longer than with one (the threads wait for busy cores); a many-core GPU host does not see that.
    torch.set_num_threads(1)
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = from_library(lib, ref, fam, skel, device="cpu", dtype=torch.bfloat16)
        t1 = time.perf_counter()
        host.put(key, a)
        t2 = time.perf_counter()
        b = host.get(key, "cpu", torch.bfloat16)
        t3 = time.perf_counter()
        assert b is not None and b.nbytes == a.nbytes
        t["library"].append(t1 - t0), t["host_write"].append(t2 - t1), t["host"].append(t3 - t2)
    torch.set_num_threads(threads)
    out = {"adapter": f"FLUX.1-Fill-dev widths, rank {rank}, attention + MLP, bfloat16", "bytes": a.nbytes,
            "modules": len(a.modules), "file_bytes": lib.file("wide").path.stat().st_size,
            "torch_threads": 1, **{f"{k}_ms": round(1000 * statistics.median(v), 1) for k, v in t.items()}}
    shutil.rmtree(host.dir, ignore_errors=True)
    return out


def plot(result: dict, path: Path) -> None:
    """Early start's SSIM loss against the step its adapters arrive, and each tier's load time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for set_name in SETS:
        rs = [r for r in result["summary"] if r["set"] == set_name and not r["without_adapters"]]
        ax1.plot([r["arrive_after"] for r in rs], [100 * r["ssim_loss_vs_without"] for r in rs], marker="o",
                 label=" + ".join(f"{n} @{w}" for n, w in SETS[set_name]))
    ax1.set_xlabel(f"adapters arrive after step (of {result['steps']})")
    ax1.set_ylabel("SSIM loss, % of the no-adapter run's")
    ax1.set_title(f"early start vs exact ({result['model']}, {result['dtype']}, {result['device']})")
    ax1.legend(fontsize=8)
    rows = result["load_ms"] + ([result["load_ms_flux_dev_widths"]] if result.get("load_ms_flux_dev_widths") else [])
    labels = [r["adapter"].split(",")[0].replace("FLUX.1-Fill-dev widths", "FLUX.1 r16") for r in rows]
    x = np.arange(len(rows))
    for i, tier in enumerate(("library", "host")):
        ax2.bar(x + (i - 0.5) * 0.38, [r[f"{tier}_ms"] for r in rows], 0.38, label=tier)
    ax2.set_xticks(x, labels, rotation=20, fontsize=8)
    ax2.set_yscale("log")
    ax2.set_ylabel("load time (ms, median)")
    ax2.set_title("adapter load by tier (device tier: ~0.005 ms)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--arrive", default="1,2,4,8", help="steps after which the adapters arrive")
    ap.add_argument("--cases", type=int, default=3, help="(template, mask) cases per adapter set")
    ap.add_argument("--repeats", type=int, default=5, help="load-time repeats per adapter and tier")
    ap.add_argument("--no-wide", dest="wide", action="store_false", help="skip the FLUX.1-width load times")
    ap.add_argument("--out", type=Path, default=RESULTS / "lora_early_start.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's JSON")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return
    scratch = Path(tempfile.mkdtemp(prefix="lora-early-"))
    s = replace(load_settings(), lora_early_start=True, lora_host_dir=scratch / "host")
    ed = LocalEditor(s)
    rows, arrive = [], [int(k) for k in args.arrive.split(",")] + [args.steps]
    try:
        for set_name, adapters in SETS.items():
            loras = json.dumps([{"name": n, "scale": w} for n, w in adapters])
            for case in range(args.cases):
                tpl = samples.template(args.size, args.size, seed=10 + case)
                mask = samples.mask(args.size, args.size, 0.3, ("box", "blob")[case % 2], seed=case)
                params = parse_params(s, "a red hat", seed=case, steps=args.steps, use_cache=False, loras=loras)
                p = ed.pre(png(tpl), png(mask), params)
                inputs = denoise_inputs(p)

                def image(latents):
                    return np.asarray(ed.dec.decode_latents(latents, p.model_w, p.model_h).convert("RGB"))

                ppt = ed.runner.pixels_per_token  # the edited pixels: the masked tokens' patches
                keep = np.kron(inputs.token_mask.reshape(p.model_h // ppt, p.model_w // ppt),
                               np.ones((ppt, ppt), bool)).astype(bool)
                exact = image(run(ed, inputs, None))
                for k in arrive:
                    out = image(run(ed, inputs, k))
                    rows.append({"set": set_name, "adapters": adapters, "case": case, "arrive_after": k,
                                 "steps": args.steps, "without_adapters": k >= args.steps,
                                 **fidelity(exact, out, keep)})
                    print(f"{set_name} case {case} k={k:>2}: SSIM {rows[-1]['ssim']:.4f} "
                          f"PSNR {rows[-1]['psnr']:.2f} (edited: {rows[-1]['ssim_edited']:.4f} / "
                          f"{rows[-1]['psnr_edited']:.2f})", flush=True)
        tiers = tier_times(ed, sorted(ed.runner.adapters.library.names()), args.repeats)
    finally:
        ed.close()
    wide = wide_tier_times(scratch, max(1, args.repeats // 2)) if args.wide else None
    summary = []
    for set_name in SETS:
        for k in arrive:
            rs = [r for r in rows if r["set"] == set_name and r["arrive_after"] == k]
            summary.append({"set": set_name, "arrive_after": k, "without_adapters": k >= args.steps,
                            **{m: round(statistics.mean(r[m] for r in rs), 4)
                               for m in ("ssim", "psnr", "ssim_edited", "psnr_edited")}})
        # the share of the no-adapter run's SSIM loss that early start still shows (0: exact, 1: no adapters)
        none = next(r for r in summary if r["set"] == set_name and r["without_adapters"])
        for r in summary:
            if r["set"] == set_name:
                r["ssim_loss_vs_without"] = round((1 - r["ssim"]) / max(1e-12, 1 - none["ssim"]), 4)
    result = {"model": Path(s.model_dir).name, "device": s.torch_device, "dtype": s.dtype, "size": args.size,
              "steps": args.steps, "command": "python -m maskedit_lab.addons.lora_early_start", "summary": summary,
              "rows": rows, "load_ms": tiers,
              "load_ms_flux_dev_widths": wide}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for r in summary:
        print(f"{r['set']:>3} arrive after {r['arrive_after']:>2}/{args.steps}: SSIM {r['ssim']:.4f} PSNR "
              f"{r['psnr']:.2f}  edited SSIM {r['ssim_edited']:.4f} PSNR {r['psnr_edited']:.2f}  SSIM loss "
              f"{r['ssim_loss_vs_without']:.1%} of the no-adapter run's")
    for r in tiers:
        print(f"{r['adapter']:>14} ({r['bytes'] / 1e6:.2f} MB): library {r['library_ms']:.1f} ms, host "
              f"{r['host_ms']:.1f} ms, device {r['device_ms']:.3f} ms")
    if wide:
        print(f"{wide['adapter']} ({wide['bytes'] / 1e6:.0f} MB): library {wide['library_ms']:.0f} ms, host write "
              f"{wide['host_write_ms']:.0f} ms, host read {wide['host_ms']:.0f} ms")
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
