"""`maskedit-calibrate`: measure block compute and cache-load latencies on this machine and model, fit the
cost model the planner and the router use, print each fit's R², and write it into the profiles directory
(``MASKEDIT_PROFILES_DIR``, in a source checkout ``perf_profiles/``): ``cost_model_<model>.json`` on the CPU,
``cost_model_<model>_<gpu>.json`` on a GPU, e.g. ``_h100``.

    maskedit-calibrate                         # the benchmark-size model (built if missing)
    maskedit-calibrate --model-dir models/tiny-flux-fill
    maskedit-calibrate --preset flux-dev --device cuda --dtype bfloat16   # FLUX.1-Fill-dev size, on a GPU

On a GPU, block times come from CUDA events around each block call (read after the step: nothing synchronises
inside it, so kernel launches overlap as they do when serving) and loads are host-to-device copies from the
entry's page-locked mapping on a side stream, timed with events.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from diffusers.hooks import HookRegistry, ModelHook
from tqdm import tqdm

from maskedit.cache.cost_model import device_slug
from maskedit.cache.integrity import chunk_dims
from maskedit.cache.loader import RowLoader, default_verify_threads
from maskedit.cache.runtime import CacheRuntime
from maskedit.denoise import DenoiseJob
from maskedit.device import SideStream, seconds_between, time_mark
from maskedit_common.blocks import FULL, KV, Y
from maskedit_common.cost_model import CostModel, LinearFit, features
from maskedit_router.placement.features import grid_tokens

from ..harness.baselines import FixedPolicy, PreloadedRowLoader
from ..harness.in_process import Harness

RATIOS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)


class BlockTimer(ModelHook):
    """Time of each block call: wall time on the CPU (synchronous), a pair of CUDA events on a GPU."""

    def __init__(self, sink: list, index: int):
        super().__init__()
        self.sink, self.index = sink, index

    def new_forward(self, module, *args, **kwargs):
        device = next(module.parameters()).device
        t0 = time_mark(device)
        out = self.fn_ref.original_forward(*args, **kwargs)
        self.sink.append((self.index, t0, time_mark(device)))
        return out


def resolve(sink: list) -> list[tuple[int, float]]:
    """(block, ms) of every timed call in ``sink`` (waiting for the GPU to pass the last event first)."""
    return [(i, 1000.0 * seconds_between(a, b, wait=True)) for i, a, b in sink]


def measure(h: Harness, reps: int = 2, ratios=RATIOS) -> tuple[dict, dict, dict]:
    base = h.register()
    n = h.hooks.cache_mask(base).size  # image tokens and any reference tokens: the rows a hit plans over
    text = base.prompt_embeds.shape[0]
    samples_ = defaultdict(list)  # (kind, mode) -> [(features, ms)]
    sink: list = []
    blocks = h.hooks.blocks
    for i, b in enumerate(blocks):  # outermost: wraps our masked-block hook
        HookRegistry.check_if_exists_or_initialize(b).register_hook(BlockTimer(sink, i), "maskedit_timer")
    kinds = getattr(h.hooks, "kinds", None) or ["dual"] * h.hooks.n_dual + ["single"] * (len(blocks) - h.hooks.n_dual)
    unet = (h.hooks.layout == "per_block")  # a UNet's blocks differ in tokens and width: features per block, as the planner asks
    loads = defaultdict(list)
    try:
        plan = [(FULL, 1.0)] + [(m, r) for m in (Y, KV) for r in ratios]
        for mode, ratio in tqdm(plan, desc="calibrating", unit="point"):
            x = h.inputs(h.mask(ratio, seed=1)) if mode != FULL else base
            policy = {FULL: "off", Y: FixedPolicy("all_y"), KV: FixedPolicy("all_kv")}[mode]
            rt = CacheRuntime(h.hooks, h.store, h.cost, policy=policy, loader=PreloadedRowLoader)
            h.runner.cache = rt
            job = DenoiseJob(x)
            h.runner.prepare(job)
            jc = job.cache
            c = n if mode == FULL else int(jc.idx_c.numel())
            sizes = _unet_sizes(h, x, jc, mode) if unet else None
            h.runner.step([job])  # warm-up
            for _ in range(reps):
                sink.clear()
                if job.step_index >= job.steps:
                    break
                h.runner.step([job])
                for i, ms in resolve(sink):
                    n_i, c_i = sizes[i] if unet else (n, c)
                    samples_[(kinds[i], mode)].append((features(mode, n_i, c_i, text), ms))
            h.runner.release(job, ok=False)
            h.runner.cache = None
            rt.close()
    finally:
        for b in blocks:
            HookRegistry.check_if_exists_or_initialize(b).remove_hook("maskedit_timer", recurse=False)
    # Memory tier: copies of 1..16 blocks' rows out of the shared mapping, as the loader does.
    entry = h.store.open(base.cache_key)
    # A UNet's widest recorded block's rows; a transformer's rows (every block alike).
    name = max((k for k in entry.arrays if k.startswith("y.")), key=lambda k: entry.arrays[k].size) if unet else "y"
    flat = entry.tensor(name).reshape(-1, entry.arrays[name].shape[-1])
    device = h.runner.device
    loads["pinned"] = device.type == "cuda" and RowLoader._page_locked(entry)
    for blocks_ in (1, 2, 3, 4, 6, 8, 12, 16):
        rows_ = min(flat.shape[0], blocks_ * n)
        src = flat[:rows_] if loads["pinned"] or device.type != "cuda" else flat[:rows_].pin_memory()
        out = torch.empty(src.shape, dtype=src.dtype, device=device)
        times = []
        for _ in range(5):
            with SideStream.shared(device, "load").use():  # on the loader's copy stream (a GPU's)
                a = time_mark(device)
                out.copy_(src, non_blocking=True)
                b = time_mark(device)
            times.append(1000.0 * seconds_between(a, b, wait=True))
        loads["mem"].append((out.numel() * out.element_size(), float(np.median(times))))
    # Verification: every chunk the loader copies is hashed first (``integrity``), on the loader's verify threads
    # ahead of the copies (a GPU's), or on the loader thread before each copy (the CPU's). The copies above are
    # raw; the planner adds this (``CostModel.load_ms``), or a GPU's ~6 GB/s of hashing hides behind 55 GB/s copies.
    # Timed on one thread (a line through 1..16 blocks' chunks): the cost model divides it by the verify threads,
    # which hash side by side a step ahead (``bench_loader`` measures whether the host's bandwidth lets them).
    loads["verify_threads"] = default_verify_threads(device.type == "cuda")
    chunk = entry.arrays[name]
    chunks = list(np.ndindex(chunk.shape[:chunk_dims(chunk.ndim)]))
    for blocks_ in (1, 2, 4, 8, 16):
        if blocks_ > len(chunks):
            break
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for i in chunks[:blocks_]:
                entry.verify(name, *i)
            times.append((time.perf_counter() - t0) * 1000.0)
        loads["verify"].append((sum(chunk[i].nbytes for i in chunks[:blocks_]), float(np.median(times))))
    # Disk tier: reading an entry's slice from a file on disk (page cache permitting).
    entry_path = next(h.store.mem_dir.glob("*.safetensors"))
    disk_copy = h.store.disk_dir / "calibration.bin"
    disk_copy.write_bytes(entry_path.read_bytes())
    size = disk_copy.stat().st_size
    for frac in (0.01, 0.02, 0.05, 0.1, 0.2):
        nbytes = int(size * frac)
        t0 = time.perf_counter()
        with open(disk_copy, "rb") as f:
            f.read(nbytes)
        loads["disk"].append((nbytes, (time.perf_counter() - t0) * 1000.0))
    disk_copy.unlink()
    return samples_, loads, shape(h, base, kinds, text)


def shape(h: Harness, base, kinds: list[str], text: int) -> dict:
    """The model's blocks as the router predicts with them (it imports no model): runs of equal blocks as
    [kind, count, tokens, width] at the calibrated resolution (a UNet's tokens per level, both guidance rows
    counted), the text tokens, and the image tokens of the router's 16-pixel grid at that resolution (its unit)."""
    n = h.hooks.cache_mask(base).size
    sizes = _unet_sizes(h, base, None, FULL) if (h.hooks.layout == "per_block") else [(n, n)] * len(kinds)
    dims = getattr(h.hooks, "dims", None) or [h.hooks.dim] * len(kinds)
    runs: list[list] = []
    for kind, (tokens, _), dim in zip(kinds, sizes, dims):
        if runs and runs[-1][0] == kind and runs[-1][2:] == [int(tokens), int(dim)]:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1, int(tokens), int(dim)])
    return {"blocks": runs, "text": int(text), "grid_tokens": grid_tokens(h.settings.resolution),
            "reference_tokens": int(h.hooks.reference_tokens(base))}  # among each block's tokens, never masked


def _unet_sizes(h: Harness, x, jc, mode: str) -> list[tuple[int, int]]:
    """Per block (tokens, computed tokens) over all the request's UNet rows, as ``CacheRuntime`` plans them."""
    from maskedit.cache.decision import latent_grid
    from maskedit.families.unet_inpaint.prepare import cfg_rows

    n = x.latents.shape[0]
    grid, r = latent_grid(x, n), cfg_rows(x.guidance)
    shapes = h.hooks.shapes(grid)
    counts = [shapes[b][0] for b in range(len(shapes))] if mode == FULL else \
        h.hooks.computed_counts(jc.computed, grid)
    return [(shapes[b][0] * r, counts[b] * r) for b in range(len(shapes))]


def fit(samples_: dict, loads: dict, meta: dict) -> CostModel:
    compute = defaultdict(dict)
    for (kind, mode), pts in samples_.items():
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if mode == FULL:  # one size only: a constant is all the data supports
            compute[kind][mode] = LinearFit([float(np.median(ys)), 0.0, 0.0, 0.0], 1.0)
        else:
            compute[kind][mode] = LinearFit.fit(xs, ys)
    load = {t: LinearFit.fit([[1.0, b / 1e6] for b, _ in pts], [ms for _, ms in pts])
            for t, pts in loads.items() if t in ("mem", "disk", "verify")}
    return CostModel(compute=dict(compute), load=load, meta={**meta, "pinned_loads": bool(loads.get("pinned")),
                                                             "verify_threads": loads.get("verify_threads", 1)})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="default: models/<preset>-flux-fill (built if missing)")
    ap.add_argument("--preset", default="bench", help="model preset when --model-dir is not given (bench, flux-dev)")
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: MASKEDIT_DEVICE or auto)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: MASKEDIT_DTYPE or float32)")
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per point: a warm-up step, then timed ones")
    ap.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS),
                    help="mask ratios timed in y and kv mode (at least two: a line through them is the fit)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.steps < 2:  # one step is all warm-up: the profile would hold no block time at all
        ap.error(f"--steps must be at least 2 (one warm-up step, then the timed ones), got {args.steps}")
    if len(set(args.ratios)) < 2 or not all(0 < r < 1 for r in args.ratios):
        ap.error(f"--ratios must be at least two different mask ratios between 0 and 1, got {args.ratios}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    h = Harness.create(args.model_dir, preset=args.preset, steps=args.steps, device=args.device, dtype=args.dtype)
    samples_, loads, structure = measure(h, ratios=args.ratios)
    model = fit(samples_, loads, {**structure,
        "model_dir": str(h.settings.model_dir), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "threads": torch.get_num_threads(), "device": h.settings.torch_device, "resolution": h.settings.resolution,
        "dtype": h.settings.dtype, "hardware": device_slug(h.runner.device),
    })
    out = args.out or h.settings.profile_path(device_slug(h.runner.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(model.to_json(), indent=2))
    for kind, d in model.compute.items():
        for mode, f in d.items():
            print(f"{kind:6s} {mode:4s} R²={f.r2:.3f}  n={len(samples_[(kind, mode)])}")
    for tier, f in model.load.items():
        print(f"load {tier:4s} R²={f.r2:.3f}  {f.coef[1]:.3f} ms/MB + {f.coef[0]:.3f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
