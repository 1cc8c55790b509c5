"""`make bench-addons`: LoRA adapters against the base edit, side by side in one run (docs/lora.md, Benchmark).

On the bench preset (~20M-parameter Flux Fill transformer, 512x512 = 1024 image tokens, 8 steps; it has no
adapters, so seeded random rank-16 attention + MLP ones are written for it into the run's temporary library),
denoising one request (adapter resolution included: what the adapters change) for each case:
  base              no adapters, on a denoiser whose layers carry the adapter hooks (a server that loaded some)
  base-unhooked     no adapters, no hooks (a server that never loaded one): what the hooks cost the others
  warm-1, warm-2    1 / 2 adapters already loaded, unmerged deltas (the Punica-style path mixed batches take)
  warm-*-merged     the same, merged into the weights (the copy is made during the request: its cost counts)
  cold-host         the adapter not in the runtime's cache (a fresh ``AdapterRuntime``), its file in the page cache
  cold-disk         the same with the file dropped from the page cache first (``posix_fadvise`` DONTNEED)
  naive             stock ``FluxFillPipeline`` per request: ``load_lora_weights``, ``fuse_lora``, run,
                    ``unfuse_lora``, ``unload_lora_weights``; its overhead is over ``stock-base`` (the same pipeline
                    without adapters, also a row)
  same-batch(-merged), mixed-batch  4 requests in one step batch: one adapter set for all vs 4 different sets
and at FLUX.1 widths (``flux_width_blocks``: one dual + one single block of the ``flux-width`` preset, 1024 image + 512
text tokens): base vs 2 rank-16 adapters, unmerged and merged. Every case's ``flop_share`` (FLOPs over base, counted
by torch's FlopCounterMode on the run itself) stands beside its measured ``overhead``. Cases interleave within each
repetition (drift in a shared machine's speed hits all alike); medians of ``--reps``; the load average is recorded.
The cold cases go through ``AdapterRuntime`` (``fresh_runtime``): a host-memory adapter tier plugs in there.
The cases are in ``lora_cases`` (timed by ``timing``), the rows and the file's merge in
``results``, the targets, plot and table in ``report``; this module runs them and is the CLI.

SDXL ControlNet section (``sdxl_controlnet``: the mask-aware cached ControlNet on ``sdxl-bench`` against the
full controlled path, and the ControlNet's overhead over the base edit): its rows (case ``sdxl-controlnet-mask``) go
into the same file, replacing only its own; plot and table in ``addons_sdxl_controlnet.json`` / ``.png``.

    make bench-addons            # CPU float32 -> perf_profiles/results/addons.json / .png (+ the SDXL section)
    make bench-addons ARGS="--cases warm-2,mixed-batch,fw:warm-2"   # those rows (and their baselines') replaced
    make bench-addons ARGS="--sdxl-controlnet"   # the SDXL ControlNet section alone; every other row kept
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from maskedit.adapters.build import write_library
from maskedit.cache.cost_model import device_slug

from .. import REPO_ROOT
# The cases, timing and results live beside this CLI; their names stay importable from here.
from ..harness.in_process import Harness, png
from .lora_cases import (NAMES, RANK, BenchCases, drop_page_cache, flux_width_cases,  # noqa: F401
                         fresh_runtime, naive_cases, use_runtime)
from .report import markdown_table, plot, targets, with_baselines
from .results import case_path, merger_costs, rows_from, write
from .timing import clock, count_flops, drive, since  # noqa: F401

RESULTS = REPO_ROOT / "perf_profiles" / "results"


def run(reps: int = 3, model_dir: Path | None = None, device: str | None = None, dtype: str | None = None,
        flux_width: bool = True, steps: int | None = None, only: set | None = None) -> tuple[list[dict], dict]:
    """``only``: run those cases (``fw:<case>`` at FLUX.1 widths) and the baselines they are measured against."""
    h = Harness.create(model_dir, preset="bench", steps=steps, device=device, dtype=dtype)
    dev, tdtype = h.runner.device, h.runner.dtype
    work = Path(tempfile.mkdtemp(prefix="maskedit-addons-"))  # on disk, not /dev/shm: cold-disk reads a file
    loads = [os.getloadavg()[0]]
    try:
        specs = tuple((n, RANK, "attn+mlp", False) for n in NAMES)
        write_library(h.settings.model_dir, h.runner.family, h.runner.transformer, out=work / "lib", seed=1,
                      specs=specs)
        bench = BenchCases(h, work / "lib")
        cases = bench.cases()
        only = None if only is None else with_baselines(only)
        cases = {c: v for c, v in cases.items() if only is None or c in only}
        stock = {"stock-base", "naive"} if only is None else {"stock-base", "naive"} & only
        stock_base, naive = naive_cases(h.settings.model_dir, work / "lib", h, dev, tdtype) if stock else (0, 0)
        fw_only = None if only is None else {c[3:] for c in only if c.startswith("fw:")}
        fw, merge_s, merged_bytes = (flux_width_cases(work / "fw", dev, tdtype, fw_only)
                                     if flux_width and fw_only != set() else ({}, 0.0, 0))
        total = (reps + 1) * (len(cases) + len(stock) + len(fw))
        bar = tqdm(total=total, desc="addons", unit="run")
        times = {c: [] for c in [*cases, *sorted(stock, reverse=True), *(f"fw:{k}" for k in fw)]}
        flops, stats, phases = {}, {}, {}
        paths = {c: case_path(mode, None) for c, (_, mode, _) in cases.items()}
        paths.update({"naive": "fused (stock fuse_lora)", "fw:warm-2": "unmerged", "fw:warm-2-merged": "merged"})
        for rep in range(reps + 1):  # rep 0: warm-up, FLOPs counted
            for c, (ins, mode, setup) in cases.items():
                v, st = bench.run(ins, mode, setup, flops=rep == 0)
                (flops.__setitem__(c, v) if rep == 0 else times[c].append(v))
                stats[c] = st
                paths[c] = case_path(mode, st)
                bar.update()
            for c, fn in [(c, fn) for c, fn in (("stock-base", stock_base), ("naive", naive)) if c in stock]:
                if rep == 0:
                    flops[c] = count_flops(fn)
                else:
                    s, ph = fn()
                    times[c].append(s)
                    phases.setdefault(c, []).append(ph)
                bar.update()
            for c, fn in fw.items():
                (flops.__setitem__(f"fw:{c}", count_flops(fn)) if rep == 0 else times[f"fw:{c}"].append(fn()))
                bar.update()
            loads.append(os.getloadavg()[0])
        bar.close()
        pre_s, dec_s = _stages(h, reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = rows_from(times, flops, stats, paths, phases, pre_s + dec_s, device_slug(dev), h.settings.dtype)
    meta = {"reps": reps, "steps": h.steps, "load_avg": {"start": loads[0], "max": max(loads), "end": loads[-1]},
            "cpu_cores": os.cpu_count(), "threads": torch.get_num_threads(), "rank": RANK, "targets": "attn+mlp",
            "pre_plus_decode_s": round(pre_s + dec_s, 4), "flux_width_merge_s": round(merge_s, 4),
            "flux_width_merged_bytes": merged_bytes, "merge_costs": merger_costs(bench.merger),
            "library": "temporary directory on the root disk (cold-disk: page cache dropped by posix_fadvise; a VM "
                       "disk may still be cached by its host)"}
    meta["targets_met"] = targets(rows) if only is None else {}
    return rows, meta


def _stages(h: Harness, reps: int) -> tuple[float, float]:
    """Median seconds of the stages around denoising (text + VAE encode; VAE decode), for end-to-end shares."""
    from maskedit.decode import Decoder

    dec = Decoder(h.settings)
    tpl, mask = png(h.template), png(h.mask(0.3, seed=1))
    pre, post = [], []
    from maskedit.params import parse_params

    for _ in range(reps):
        t0 = time.perf_counter()
        p = h.pre(tpl, mask, parse_params(h.settings, "a red dress", steps=h.steps))
        pre.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dec.decode_latents(p.latents, p.model_w, p.model_h)
        post.append(time.perf_counter() - t0)
    return statistics.median(pre), statistics.median(post)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-dir", type=Path, default=None, help="the bench preset (default: models/bench-flux-fill, "
                    "built if missing)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's); 1 on a "
                    "host shared with other work, where threads of one op wait on each other when descheduled")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the preset's, 8)")
    ap.add_argument("--no-flux-width", action="store_true", help="skip the FLUX.1-width blocks")
    ap.add_argument("--cases", default=None, help="comma-separated cases to run (`fw:<case>` at FLUX.1 widths; their "
                    "baselines are added): their rows replace those in the existing --out file, the others stay")
    ap.add_argument("--out", type=Path, default=None, help="default: results/addons.json (addons_<gpu>.json on a GPU)")
    ap.add_argument("--sdxl-controlnet", action="store_true", help="run only the SDXL ControlNet section and merge its "
                    "rows into --out (the LoRA and Flux ControlNet rows stay)")
    ap.add_argument("--no-sdxl-controlnet", action="store_true", help="skip the SDXL ControlNet section")
    ap.add_argument("--cn-preset", default="sdxl-bench", help="the SDXL ControlNet section's preset")
    ap.add_argument("--cn-steps", type=int, default=4, help="the SDXL ControlNet section's steps")
    ap.add_argument("--cn-ratios", default="0.1,0.2,0.5", help="the SDXL ControlNet section's mask ratios")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sdxl_controlnet:
        sdxl_controlnet(args, args.out or RESULTS / "addons.json")
        return
    t0 = time.time()
    only = None if args.cases is None else {c.strip() for c in args.cases.split(",") if c.strip()}
    rows, meta = run(args.reps, args.model_dir, args.device, args.dtype, not args.no_flux_width, args.steps, only)
    hw = rows[0]["device"]
    out = args.out or RESULTS / ("addons.json" if hw == "cpu" else f"addons_{hw}.json")
    meta.update({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                 "seconds": round(time.time() - t0, 1), "device": hw, "dtype": rows[0]["dtype"]})
    rows, meta = write(out, rows, meta, only)
    plot(rows, out.with_suffix(".png"), RANK, meta["steps"])
    print(markdown_table(rows))
    print(json.dumps(meta["targets_met"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')} in {meta['seconds']} s (load avg {meta['load_avg']})")
    if not args.no_sdxl_controlnet and only is None:
        sdxl_controlnet(args, out)


def sdxl_controlnet(args, out: Path) -> None:
    """The SDXL ControlNet section (``sdxl_controlnet``): its rows merged into ``out``."""
    from . import sdxl_controlnet as cn

    cn.section(out, args.cn_preset, args.cn_steps, args.reps,
               tuple(float(r) for r in args.cn_ratios.split(",") if r.strip()))


if __name__ == "__main__":
    main()
