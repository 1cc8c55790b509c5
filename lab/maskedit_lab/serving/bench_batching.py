"""`maskedit-bench-batching`: static vs naive continuous vs disaggregated continuous batching, side by side.

One process serves the same Poisson workload (InstGenIE's "public" mask ratios, Zipf-popular templates whose
activations are registered first, the benchmark-size model) three ways at three offered rates:
  static         batches form only when the running batch is empty and run to completion; pre/post-processing
                 (image decode, text + VAE encode / VAE decode + PNG) in worker processes
  naive          continuous batching, but pre/post-processing runs inline on the denoise loop's thread
  disaggregated  continuous batching with pre/post-processing in worker processes (what the Triton ensemble does)
and, with ``--modes``, two more for GPUs (where a step of b requests costs about b steps of one):
  fcfs           one request at a time, first come first served (pre/post-processing in workers)
  priority       the ``priority`` scheduler: least remaining work / least slack first, preemption at step
                 boundaries, bounded waiting (pre/post-processing in workers)
It also measures closed-loop throughput at batch size 1 vs 4 at mask ratio 0.2, and for a batch mixing two
resolutions, one packed transformer call per step against one call per resolution. Writes JSON and plots.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import multiprocessing as mp
import numpy as np
import torch
from tqdm import tqdm

from maskedit import samples
from maskedit.cache.cost_model import CostModel, device_slug
from ..harness.in_process import Harness, png
from maskedit.denoise import DenoiseJob
from maskedit.local import denoise_inputs
from maskedit.params import parse_params
from maskedit.scheduler import BatchScheduler

from .. import REPO_ROOT

RESULTS = REPO_ROOT / "perf_profiles" / "results"
_worker: dict = {}


def _init_worker(model_dir: str, kind: str, mem: str, disk: str) -> None:
    torch.set_num_threads(1)
    from maskedit.cache.store import ActivationStore
    from maskedit.decode import Decoder
    from maskedit.preprocess import Preprocessor
    from maskedit_common.settings import load_settings

    s = load_settings({"MASKEDIT_MODEL_DIR": model_dir})
    if kind == "pre":
        _worker["pre"] = Preprocessor(s, store=ActivationStore(mem, disk, 64 << 30, 64 << 30))
    else:
        _worker["dec"] = Decoder(s)


def _preprocess(template: bytes, mask: bytes, prompt: str, seed: int, steps: int):
    pre = _worker["pre"]
    p = pre(template, mask, parse_params(pre.settings, prompt, seed=seed, steps=steps))
    return denoise_inputs(p), p.template_rgb, p.alpha


def _decode(latents, w: int, h: int, template_rgb, alpha) -> int:
    dec = _worker["dec"]
    return len(dec.finish(dec.decode_latents(latents, w, h), template_rgb, alpha, False, False))


# mode -> (scheduler policy, batch size or None for --max-batch)
MODES = {"static": ("static", None), "naive": ("continuous", None), "disaggregated": ("continuous", None),
         "fcfs": ("continuous", 1), "priority": ("priority", None)}


class Server:
    """The three stages in one process, wired as one of ``MODES``."""

    def __init__(self, h: Harness, mode: str, max_batch: int = 4):
        self.h, self.mode = h, mode
        policy, batch = MODES[mode]
        self.inline = mode == "naive"
        self.engine, self.rt = h.engine("planner", scheduler=BatchScheduler(policy, max_batch=batch or max_batch),
                                        inline_work=self.inline)
        if not self.inline:
            ctx = mp.get_context("spawn")
            dirs = (str(h.settings.model_dir), str(h.store.mem_dir), str(h.store.disk_dir))
            self.pre = ProcessPoolExecutor(1, ctx, initializer=_init_worker, initargs=(dirs[0], "pre", *dirs[1:]))
            self.dec = ProcessPoolExecutor(1, ctx, initializer=_init_worker, initargs=(dirs[0], "dec", *dirs[1:]))
            # Warm both workers (model load) before timing.
            self.pre.submit(int).result()
            self.dec.submit(int).result()
        else:
            from maskedit.decode import Decoder

            self.decoder = Decoder(h.settings)

    def submit(self, template: bytes, mask: bytes, prompt: str, seed: int, steps: int, on_done) -> None:
        t_arrive = time.perf_counter()

        def start(inputs, template_rgb, alpha):
            def finished(job: DenoiseJob):
                latents = job.result()
                meta = {"queue_s": job.started_at - job.submitted_at, "denoise_s": job.finished_at - job.started_at}
                if self.inline:  # on the loop thread: the batch waits for this decode
                    self.decoder.finish(self.decoder.decode_latents(latents, inputs.model_w, inputs.model_h),
                                        template_rgb, alpha, False, False)
                    on_done(t_arrive, meta, None)
                else:
                    f = self.dec.submit(_decode, latents, inputs.model_w, inputs.model_h, template_rgb, alpha)
                    f.add_done_callback(lambda f: on_done(t_arrive, meta, f.exception()))

            self.engine.submit(DenoiseJob(inputs, on_done=finished, on_error=lambda j, e: on_done(t_arrive, {}, e)))

        if self.inline:
            def pre_inline():
                p = self.h.pre(template, mask, parse_params(self.h.settings, prompt, seed=seed, steps=steps))
                start(denoise_inputs(p), p.template_rgb, p.alpha)
            self.engine.call_soon(pre_inline)
        else:
            f = self.pre.submit(_preprocess, template, mask, prompt, seed, steps)
            f.add_done_callback(lambda f: start(*f.result()) if not f.exception() else on_done(t_arrive, {}, f.exception()))

    def close(self) -> None:
        self.engine.shutdown()
        self.rt.close()
        if not self.inline:
            self.pre.shutdown()
            self.dec.shutdown()


def run_workload(server: Server, requests, assets) -> dict:
    lat, queue, errors = [], [], 0
    done = threading.Semaphore(0)
    lock = threading.Lock()

    def on_done(t_arrive, meta, err):
        nonlocal errors
        with lock:
            if err is None:
                lat.append(time.perf_counter() - t_arrive)
                queue.append(meta.get("queue_s", 0.0))
            else:
                errors += 1
        done.release()

    steps0 = server.engine.steps_run
    over0, cb0, pr0 = server.engine.overhead_s, server.engine.callback_s, server.engine.prepare_s
    t0 = time.perf_counter()
    for r, (tpl, mask) in zip(requests, assets):
        delay = r.t - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        server.submit(tpl, mask, r.prompt, r.seed, r.steps, on_done)
    for _ in requests:
        done.acquire(timeout=600)
    wall = time.perf_counter() - t0
    steps = server.engine.steps_run - steps0
    return {
        "mean_s": statistics.mean(lat), "p50_s": float(np.percentile(lat, 50)), "p95_s": float(np.percentile(lat, 95)),
        "queue_s": statistics.mean(queue), "throughput": len(lat) / wall, "errors": errors,
        "step_overhead_ms": 1000 * (server.engine.overhead_s - over0) / max(1, steps),
        "inline_ms_per_step": 1000 * (server.engine.callback_s - cb0) / max(1, steps),
        "prepare_ms_per_step": 1000 * (server.engine.prepare_s - pr0) / max(1, steps),
        "steps_run": steps, "max_running": server.engine.max_running,
    }


def closed_loop(h: Harness, inputs: list, batch: int, pack: bool = True) -> dict:
    """Submit every input at once to an engine of max batch ``batch`` and wait for all: wall time, steps run and
    transformer calls made."""
    eng, rt = h.engine("planner", scheduler=BatchScheduler("continuous", max_batch=batch), max_queue=len(inputs),
                       pack=pack)
    left = threading.Semaphore(0)
    calls = []
    hook = h.runner.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    t0 = time.perf_counter()
    for x in inputs:
        eng.submit(DenoiseJob(x, on_done=lambda j: left.release(), on_error=lambda j, e: left.release()))
    for _ in inputs:
        left.acquire(timeout=600)
    wall = time.perf_counter() - t0
    hook.remove()
    eng.shutdown()
    rt.close()
    return {"wall_s": wall, "steps": eng.steps_run, "calls": len(calls)}


def closed_loop_throughput(h: Harness, batch: int, n: int = 16) -> float:
    return n / closed_loop(h, [h.inputs(h.mask(0.2, seed=7))] * n, batch)["wall_s"]


def batching_ceilings(h: Harness, batch: int) -> dict:
    """What batching can gain on this machine's kernels for the closed-loop request (mask ratio 0.2, its plan):
    ``KernelTimer.batching_ceiling`` with cache-hot and with streamed weights."""
    from maskedit_common.flops import edges
    from ..engine.kernel_ceiling import KernelTimer
    from maskedit.local import run_job

    x = h.inputs(h.mask(0.2, seed=7))
    eng, rt = h.engine("planner")
    try:
        jc = run_job(eng, x).cache
    finally:
        eng.shutdown()
        rt.close()
    cfg = h.runner.transformer.config
    plan = (jc.modes, cfg.num_layers, x.latents.shape[0], int(jc.idx_c.numel()), x.prompt_embeds.shape[0],
            cfg.num_attention_heads * cfg.attention_head_dim)
    hot, streamed = KernelTimer.hot_and_streamed(cfg.num_attention_heads, h.runner.device, h.runner.dtype)
    return {"kernel_ceiling": hot.batching_ceiling(*plan, batch, **edges(cfg)),
            "streamed_ceiling": streamed.batching_ceiling(*plan, batch, **edges(cfg))}


def mixed_resolution(h: Harness, inputs: list, pack: bool) -> dict:
    """Closed loop at batch 4 over requests of two resolutions (cache hits): per-step time and throughput."""
    r = closed_loop(h, inputs, 4, pack)
    return {"mode": "mixed_resolution", "pack": pack, "batch": 4, "rate": None,
            "throughput": len(inputs) / r["wall_s"], "step_ms": 1000 * r["wall_s"] / r["steps"],
            "calls_per_step": r["calls"] / r["steps"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rates", type=float, nargs="*", help="req/s; default: 0.4x, 0.9x, 1.5x of measured capacity")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", nargs="*", choices=sorted(MODES), default=["static", "naive", "disaggregated"])
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default=None, help="cpu, cuda (default: MASKEDIT_DEVICE or auto)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: MASKEDIT_DTYPE or float32)")
    ap.add_argument("--out", type=Path, default=RESULTS / "batching.json")
    args = ap.parse_args(argv)
    from loadgen import workload

    h = Harness.create(preset=args.preset, steps=args.steps, device=args.device, dtype=args.dtype)
    profile = h.settings.cost_profile_for(device_slug(h.runner.device))
    h.cost = CostModel.load_file(profile) if profile.exists() else CostModel.fallback()
    size = h.settings.resolution
    n_templates = 4
    templates = []
    for t in range(n_templates):  # register every template so requests hit the activation cache
        h.template = samples.template(size, size, seed=1000 + t)
        h.register()
        templates.append(png(h.template))
    rows = []
    thr1 = closed_loop_throughput(h, 1)
    thr4 = closed_loop_throughput(h, 4)
    rows += [{"mode": "closed_loop", "rate": None, "batch": 1, "throughput": thr1},
             {"mode": "closed_loop", "rate": None, "batch": 4, "throughput": thr4, "vs_batch1": thr4 / thr1,
              **batching_ceilings(h, 4)}]
    mixed = []  # two templates of different aspect (different token grids), alternating
    for t, (w, hgt) in enumerate(((size, size), (size * 5 // 4, size * 3 // 4))):
        h.template = samples.template(w, hgt, seed=2000 + t)
        h.register()
        mixed.append(h.inputs(h.mask(0.2, seed=7)))
    mixed = [mixed[i % 2] for i in range(8)]
    for pack in (False, True):
        rows.append(mixed_resolution(h, mixed, pack))
    rows[-1]["vs_per_resolution"] = rows[-1]["throughput"] / rows[-2]["throughput"]
    print(rows[-2:], flush=True)
    rates = args.rates or [round(f * thr1, 3) for f in (0.4, 0.9, 1.5)]
    reqs_by_rate = {}
    for rate in rates:
        reqs = workload.poisson(rate, args.requests, workload="public", n_templates=n_templates, steps=args.steps,
                                seed=int(rate * 1000))
        assets = [(templates[r.template], png(samples.mask(size, size, r.mask_ratio, r.mask_shape, seed=r.seed)))
                  for r in reqs]
        reqs_by_rate[rate] = (reqs, assets)
    for mode in tqdm(args.modes, desc="modes"):
        server = Server(h, mode, args.max_batch)
        try:
            for rate in rates:
                reqs, assets = reqs_by_rate[rate]
                res = run_workload(server, reqs, assets)
                rows.append({"mode": mode, "rate": rate, **{k: (round(v, 4) if isinstance(v, float) else v)
                                                            for k, v in res.items()}})
                print(rows[-1], flush=True)
        finally:
            server.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": {"requests_per_run": args.requests, "steps": args.steps,
                                             "workload": "public", "templates": n_templates}, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(markdown(rows))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def markdown(rows) -> str:
    out = ["| mode | rate req/s | mean s | P95 s | queue s | throughput req/s | batching overhead ms/step | "
           "callbacks + inline work ms/step |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["mode"] in ("closed_loop", "mixed_resolution"):
            continue
        out.append(f"| {r['mode']} | {r['rate']:.2f} | {r['mean_s']:.2f} | {r['p95_s']:.2f} | {r['queue_s']:.2f} | "
                   f"{r['throughput']:.2f} | {r['step_overhead_ms']:.2f} | {r['inline_ms_per_step']:.1f} |")
    cl = {r["batch"]: r for r in rows if r["mode"] == "closed_loop"}
    out.append(f"\nclosed loop at mask ratio 0.2: batch 1 {cl[1]['throughput']:.2f} req/s, batch 4 "
               f"{cl[4]['throughput']:.2f} req/s ({cl[4]['vs_batch1']:.2f}x; what the kernels allow: "
               f"{cl[4].get('kernel_ceiling', float('nan')):.2f}x cache-hot, "
               f"{cl[4].get('streamed_ceiling', float('nan')):.2f}x weights streamed)")
    mx = {r["pack"]: r for r in rows if r["mode"] == "mixed_resolution"}
    if mx:
        out.append(f"two resolutions at batch 4: one call per resolution {mx[False]['step_ms']:.0f} ms/step, "
                   f"{mx[False]['throughput']:.2f} req/s; packed into one call {mx[True]['step_ms']:.0f} ms/step, "
                   f"{mx[True]['throughput']:.2f} req/s ({mx[True]['vs_per_resolution']:.2f}x)")
    return "\n".join(out)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for mode in dict.fromkeys(r["mode"] for r in rows if r["rate"] is not None):
        rs = sorted([r for r in rows if r["mode"] == mode], key=lambda r: r["rate"])
        x = [r["rate"] for r in rs]
        axes[0].plot(x, [r["p95_s"] for r in rs], marker="o", label=mode)
        axes[1].plot(x, [r["mean_s"] for r in rs], marker="o", label=mode)
        axes[2].plot(x, [r["throughput"] for r in rs], marker="o", label=mode)
    for ax, t in zip(axes, ("P95 latency (s)", "mean latency (s)", "throughput (req/s)")):
        ax.set(xlabel="offered rate (req/s)", title=t)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
