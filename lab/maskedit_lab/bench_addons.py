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
and at FLUX.1 widths (``addon_blocks``: one dual + one single block of the ``flux-width`` preset, 1024 image + 512
text tokens): base vs 2 rank-16 adapters, unmerged and merged. Every case's ``flop_share`` (FLOPs over base, counted
by torch's FlopCounterMode on the run itself) stands beside its measured ``overhead``. Cases interleave within each
repetition (drift in a shared machine's speed hits all alike); medians of ``--reps``; the load average is recorded.
The cold cases go through ``AdapterRuntime`` (``fresh_runtime``): a host-memory adapter tier plugs in there.

SDXL ControlNet section (``addons_sdxl_controlnet``: the mask-aware cached ControlNet on ``sdxl-bench`` against the
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
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from maskedit.adapters import delta, merge
from maskedit.adapters.build import write_library
from maskedit.adapters.library import AdapterLibrary
from maskedit.adapters.runtime import AdapterRuntime
from maskedit.cache.cost_model import device_slug
from maskedit.denoise import DenoiseJob

from . import REPO_ROOT, addon_blocks
from .addons_report import markdown_table, merge_rows, plot, relate, targets, with_baselines
from .harness import Harness, png

RESULTS = REPO_ROOT / "perf_profiles" / "results"
RANK = 16
NAMES = ("r16-a", "r16-b", "r16-c", "r16-d")


def count_flops(fn) -> int:
    """FLOPs of ``fn()`` by torch's FlopCounterMode (matmuls and attention; on the CPU its flash-attention kernel is
    counted with the same formula as the GPU's)."""
    from torch.utils import flop_counter as fc

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None and op not in fc.flop_registry:
        fc.register_flop_formula(op)(lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v))
    with fc.FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def clock() -> tuple[float, float]:
    """(wall, this process's CPU) seconds: on a shared host the CPU time is what other processes disturb least."""
    return time.perf_counter(), time.process_time()


def since(t0) -> tuple[float, float]:
    t = clock()
    return t[0] - t0[0], t[1] - t0[1]


def drive(runner, inputs) -> tuple[float, float]:
    """(wall, CPU) seconds to denoise ``inputs`` together, one step batch (adapters resolved, and loaded if cold,
    in ``prepare`` as at admission)."""
    t0 = clock()
    jobs = [DenoiseJob(x) for x in inputs]
    for j in jobs:
        runner.prepare(j)
    while not all(j.done for j in jobs):
        runner.step([j for j in jobs if not j.done])
    _sync(runner.device)
    return since(t0)


def fresh_runtime(runner, library_dir: Path) -> AdapterRuntime:
    """A runtime whose per-process cache is empty (a fresh library too: the file's digest is read again). A shared
    host-memory adapter tier would be handed in here (cold-host: a hit there, a miss here)."""
    return AdapterRuntime(runner.family, runner.transformer, AdapterLibrary(library_dir))


def use_runtime(runner, runtime: AdapterRuntime) -> None:
    """The runner resolves (and loads) requests' adapters with ``runtime`` from now on."""
    from maskedit.adapters.jobs import AdapterJobs

    runner._adapter_jobs = AdapterJobs(runtime)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class BenchCases:
    """The bench preset's cases: each a (setup, run) on the shared runner."""

    def __init__(self, h: Harness, lib_dir: Path):
        self.h, self.runner, self.lib_dir = h, h.runner, lib_dir
        self.warm = AdapterRuntime(self.runner.family, self.runner.transformer, AdapterLibrary(lib_dir))
        use_runtime(self.runner, self.warm)
        self.merger = merge.merger_for(self.runner.transformer)
        self.x = h.inputs(h.mask(0.3, seed=1))
        lib = AdapterLibrary(lib_dir)
        self.refs = {n: lib.file(n) for n in NAMES}
        self.loaded = {n: self.warm.get(self._ref(n)) for n in NAMES}
        for a in self.loaded.values():  # hooks go on here (serving puts them on at admission)
            delta.attach(self.runner.transformer, a)
        drive(self.runner, [self._with(NAMES[0])])  # warm-up; the merge cost model measures its constants here

    def _ref(self, name: str, scale: float = 0.8):
        from maskedit.adapters.library import ResolvedRef

        return ResolvedRef(name, scale, self.refs[name].digest)

    def _with(self, *names):
        return replace(self.x, loras=tuple(self._ref(n, 0.8 - 0.2 * i) for i, n in enumerate(names)))

    def cases(self) -> dict:
        one, two = self._with(NAMES[0]), self._with(NAMES[0], NAMES[1])
        mixed = [self._with(n) for n in NAMES]
        return {  # case -> (inputs, merge mode, how the runtime is set up)
            "base": ([self.x], "auto", "warm"), "base-unhooked": ([self.x], "auto", "unhooked"),
            "warm-1": ([one], "never", "warm"), "warm-1-merged": ([one], "always", "warm"),
            "warm-2": ([two], "never", "warm"), "warm-2-merged": ([two], "always", "warm"),
            "cold-host": ([one], "auto", "cold-host"), "cold-disk": ([one], "auto", "cold-disk"),
            "same-batch": ([one] * 4, "never", "warm"), "same-batch-merged": ([one] * 4, "always", "warm"),
            "mixed-batch": (mixed, "never", "warm"), "base-batch": ([self.x] * 4, "auto", "warm"),
        }

    def run(self, inputs, mode: str, setup: str, flops: bool = False):
        """One run of a case; returns (seconds or FLOPs, merger stats delta)."""
        t = self.runner.transformer
        self.merger.mode = mode
        self.merger.clear()  # merged cases pay their merge
        use_runtime(self.runner, self.warm)
        if setup == "unhooked":
            delta.detach(t)
        elif setup.startswith("cold"):
            use_runtime(self.runner, fresh_runtime(self.runner, self.lib_dir))
            if setup == "cold-disk":
                drop_page_cache(self.refs[NAMES[0]].path)
            else:
                self.refs[NAMES[0]].path.read_bytes()  # in the page cache
        before = dict(self.merger.stats)
        try:
            out = count_flops(lambda: drive(self.runner, inputs)) if flops else drive(self.runner, inputs)
        finally:
            if setup == "unhooked":
                for a in self.loaded.values():
                    delta.attach(t, a)
            use_runtime(self.runner, self.warm)
            self.merger.mode = "auto"
        return out, {k: self.merger.stats[k] - before[k] for k in before}


def naive_cases(model_dir: Path, lib_dir: Path, h: Harness, device, dtype):
    """The stock pipeline, base and with the per-request LoRA lifecycle users write today; returns two callables
    giving (seconds, {phase: seconds})."""
    from diffusers import FluxFillPipeline

    pipe = FluxFillPipeline.from_pretrained(model_dir, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    tpl, mask = h.template, h.mask(0.3, seed=1)
    from PIL import Image

    kw = dict(prompt="a red dress", image=tpl, mask_image=Image.fromarray(mask), height=tpl.height,
              width=tpl.width, num_inference_steps=h.steps, guidance_scale=30.0, output_type="latent",
              max_sequence_length=h.settings.max_sequence_length)

    def base():
        t0 = clock()
        pipe(generator=torch.Generator("cpu").manual_seed(0), **kw)
        _sync(device)
        return since(t0), {}

    def naive():
        phases, t0 = {}, clock()
        steps = [("load", lambda: pipe.load_lora_weights(str(lib_dir / NAMES[0]), adapter_name="a",
                                                         weight_name="pytorch_lora_weights.safetensors")),
                 ("fuse", lambda: pipe.fuse_lora(lora_scale=0.8)),
                 ("run", lambda: pipe(generator=torch.Generator("cpu").manual_seed(0), **kw)),
                 ("unfuse", pipe.unfuse_lora), ("unload", pipe.unload_lora_weights)]
        for name, fn in steps:
            s = time.perf_counter()
            fn()
            _sync(device)
            phases[name] = time.perf_counter() - s
        return since(t0), phases

    return base, naive


def flux_width_cases(work: Path, device, dtype, only=None):
    """(name -> callable giving seconds) for the FLUX.1-width blocks: base, 2 adapters unmerged and merged (the
    merged copies made once beforehand, as for a set that stays: their making is timed as ``merge_s``); ``only``:
    those names."""
    blocks, runtime, adapters = addon_blocks.build(work, device=device, dtype=dtype)
    x = blocks.inputs(device=device, dtype=dtype)
    m = merge.Merger(budget_bytes=64 << 30, mode="always")
    unmerged = merge.Merger(mode="never").plan([adapters])
    merged = m.plan([adapters], calls_left=10 ** 6)

    def call(plan):
        def fn():
            t0 = clock()
            with delta.active(plan):
                blocks(**x)
            _sync(device)
            return since(t0)
        return fn

    fns = {"base": call(None), "warm-2": call(unmerged), "warm-2-merged": call(merged)}
    fns = {k: f for k, f in fns.items() if only is None or k in only}
    merge_s = call(merged)()[0] if "warm-2-merged" in fns else 0.0  # makes and keeps the merged copies
    return fns, merge_s, m.resident_bytes


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
        paths = {c: _path(mode, None) for c, (_, mode, _) in cases.items()}
        paths.update({"naive": "fused (stock fuse_lora)", "fw:warm-2": "unmerged", "fw:warm-2-merged": "merged"})
        for rep in range(reps + 1):  # rep 0: warm-up, FLOPs counted
            for c, (ins, mode, setup) in cases.items():
                v, st = bench.run(ins, mode, setup, flops=rep == 0)
                (flops.__setitem__(c, v) if rep == 0 else times[c].append(v))
                stats[c] = st
                paths[c] = _path(mode, st)
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
    rows = _rows(times, flops, stats, paths, phases, pre_s + dec_s, device_slug(dev), h.settings.dtype)
    meta = {"reps": reps, "steps": h.steps, "load_avg": {"start": loads[0], "max": max(loads), "end": loads[-1]},
            "cpu_cores": os.cpu_count(), "threads": torch.get_num_threads(), "rank": RANK, "targets": "attn+mlp",
            "pre_plus_decode_s": round(pre_s + dec_s, 4), "flux_width_merge_s": round(merge_s, 4),
            "flux_width_merged_bytes": merged_bytes, "merge_costs": _costs(bench.merger),
            "library": "temporary directory on the root disk (cold-disk: page cache dropped by posix_fadvise; a VM "
                       "disk may still be cached by its host)"}
    meta["targets_met"] = targets(rows) if only is None else {}
    return rows, meta


def _path(mode: str, st) -> str:
    if mode != "auto" or st is None:
        return {"never": "unmerged", "always": "merged"}.get(mode, "-")
    m, u = st["merged_calls"], st["unmerged_calls"]
    return "auto: merged" if m and not u else "auto: unmerged" if u and not m else "auto: both" if m else "-"


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


def _costs(m) -> dict | None:
    c = m.costs
    return None if c is None else {"delta_gflops": round(c.delta_flops / 1e9, 2), "merge_gflops":
                                   round(c.merge_flops / 1e9, 2), "layer_us": round(c.layer_s * 1e6, 1)}


def _rows(times, flops, stats, paths, phases, around_s, device, dtype) -> list[dict]:
    med = {c: statistics.median(w for w, _ in v) for c, v in times.items() if v}
    cpu = {c: statistics.median(u for _, u in v) for c, v in times.items() if v}
    rows = []
    for c, v in times.items():
        fw = c.startswith("fw:")
        case = c[3:] if fw else c
        base = ("fw:base" if fw else "stock-base" if c == "naive" else "base-batch" if "batch" in c else "base")
        row = {"case": case, "preset": "flux-width (1 dual + 1 single block)" if fw else "bench",
               "device": device, "dtype": dtype, "latency_s": round(med[c], 4),
               "latencies_s": [round(t, 4) for t, _ in v], "cpu_s": round(cpu[c], 4),
               "baseline": base.removeprefix("fw:"),
               "overhead": round(med[c] / med[base] - 1, 4), "overhead_cpu": round(cpu[c] / cpu[base] - 1, 4),
               "flop_share": round(flops[c] / flops[base] - 1, 4),
               "requests": 4 if "batch" in c else 1}
        if "batch" in c:
            row["throughput_rps"], row["throughput_rps_cpu"] = round(4 / med[c], 3), round(4 / cpu[c], 3)
        if not fw and c not in ("naive", "stock-base") and "batch" not in c and "base" in med:
            row["e2e_overhead"] = round((med[c] - med["base"]) / (med["base"] + around_s), 4)
            row["e2e_overhead_cpu"] = round((cpu[c] - cpu["base"]) / (cpu["base"] + around_s), 4)
        st = stats.get(c)
        row["path"] = paths.get(c, "-")
        if st and st["merges"]:
            row["merge_s"] = round(st["merge_s"], 4)
        if c in phases:
            row["phases_s"] = {k: round(statistics.median(p[k] for p in phases[c]), 4) for k in phases[c][0]}
        rows.append(row)
    relate(rows)
    return rows


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
    if only is not None and out.exists():  # a partial run: its rows replace the old ones, its meta is recorded
        prev = json.loads(out.read_text())
        rows = merge_rows(prev["rows"], rows)
        part = {k: meta[k] for k in ("reps", "steps", "load_avg", "threads", "seconds", "merge_costs",
                                     "flux_width_merge_s")}
        part["cases"] = sorted(with_baselines(only))
        meta = prev["meta"]
        meta.setdefault("partial_runs", []).append(part)
        meta["targets_met"] = targets(rows)
    elif out.exists():  # a full run: other benchmarks' rows and meta in the file stay
        prev = json.loads(out.read_text())
        rows = rows + [r for r in prev["rows"] if "requests" not in r]
        meta.update({k: v for k, v in prev["meta"].items() if k not in meta and k != "partial_runs"})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"), RANK, meta["steps"])
    print(markdown_table(rows))
    print(json.dumps(meta["targets_met"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')} in {meta['seconds']} s (load avg {meta['load_avg']})")
    if not args.no_sdxl_controlnet and only is None:
        sdxl_controlnet(args, out)


def sdxl_controlnet(args, out: Path) -> None:
    """The SDXL ControlNet section (``addons_sdxl_controlnet``): its rows merged into ``out``."""
    from . import addons_sdxl_controlnet as cn

    cn.section(out, args.cn_preset, args.cn_steps, args.reps,
               tuple(float(r) for r in args.cn_ratios.split(",") if r.strip()))


if __name__ == "__main__":
    main()
