"""`make bench-loader`: the row loader's host time for one step of a cached hit, by verify threads.

A hit's step reads every recorded block's rows: the loader verifies each block's chunk against its checksum and
queues its copy to the device. On the H200 the loader thread doing both took ~4 ms a FLUX.1 block against a
0.45 ms copy and bounded the step (docs/gpu.md). This times the real ``RowLoader`` over one step of a stored entry
at a model's widths (FLUX.1: 57 blocks of 4096 x 3072 bf16 rows, 1.4 GB), with the blocks taking their rows as soon
as they arrive (no compute): the loader alone (1 verify thread), with verify threads, and copying without verifying
(verify threads 0: the floor, what the hashing costs), interleaved in one run.
On the CPU a load is a host copy as well; on a GPU it is a queued copy from the page-locked mapping.

    python -m maskedit_lab.engine.bench_loader                  # this machine, CPU, FLUX.1 widths
    python -m maskedit_lab.engine.bench_loader --device cuda    # a GPU's loader (tools/device/gpu_check.sh loader)
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
from types import SimpleNamespace

import torch
from tqdm import tqdm
import xxhash

from maskedit.cache.cost_model import device_slug
from maskedit.cache.loader import Y_ROWS, RowLoader, usable_cores
from maskedit.cache.store import ActivationStore
from maskedit.device import synchronize

from ..harness.in_process import memory_dir
from .bench_engine import RESULTS


class CopyOnlyRowLoader(RowLoader):
    """The floor, not a serving mode: the loader with no verification at all (what the hashing costs)."""

    def load(self, jc, step: int, b: int, kind: str, verified: bool = False):
        return super().load(jc, step, b, kind, verified=True)


def store_step(root: Path, blocks: int, tokens: int, dim: int, dtype: torch.dtype):
    """One step's Y rows of every block, stored and opened as a hit's entry is (checksummed, mapped)."""
    store = ActivationStore(root / "mem", root / "disk", 1 << 40, 1 << 40)
    y = torch.empty((1, blocks, tokens, dim), dtype=dtype)
    for b in range(blocks):  # distinct contents per block; xxh3's speed does not depend on them
        y[0, b] = b
    store.put("bench", {"y": y}, {"y_blocks": list(range(blocks)), "kv_blocks": []})
    return store.open("bench")


def time_step(entry, device, blocks: int, threads: int) -> tuple[float, float]:
    """(seconds from the step's start until the last block holds its rows on the device, loader-thread seconds);
    ``threads`` 0: copies only, nothing verified."""
    cls = CopyOnlyRowLoader if threads == 0 else RowLoader
    loader = cls(device, heads=1, head_dim=entry.arrays["y"].shape[-1], verify_threads=max(1, threads))
    try:
        jc = SimpleNamespace(entry=entry, modes=[Y_ROWS] * blocks, futures={}, load_s=0.0, text_len=0)
        synchronize(device)
        t0 = time.perf_counter()
        reached = loader.start_step([(jc, 0)], lambda jc, b: [Y_ROWS])
        get = loader.rows(jc, 0)
        for b in range(blocks):
            reached(b)
            get(b, Y_ROWS)
        synchronize(device)
        return time.perf_counter() - t0, jc.load_s
    finally:
        loader.close()


def run(blocks: int, tokens: int, dim: int, dtype: torch.dtype, device: str, threads: list[int],
        reps: int) -> list[dict]:
    need = blocks * tokens * dim * dtype.itemsize
    root = Path(tempfile.mkdtemp(prefix="maskedit-bench-loader-", dir=memory_dir(need)))
    try:
        entry = store_step(root, blocks, tokens, dim, dtype)
        step_bytes = entry.arrays["y"].nbytes
        time_step(entry, device, blocks, threads[0])  # warm-up: maps the pages, page-locks them on a GPU
        threads = [*threads, 0]
        times = {n: [] for n in threads}
        for _ in tqdm(range(reps), desc="reps"):
            for n in threads:  # interleaved, so drift in machine speed hits every setting alike
                times[n].append(time_step(entry, device, blocks, n))
        base = statistics.median(t for t, _ in times[threads[0]])
        rows = []
        for n in threads:
            step_s = statistics.median(t for t, _ in times[n])
            rows.append({"verify_threads": n, "step_s": round(step_s, 5),
                         "loader_thread_s": round(statistics.median(s for _, s in times[n]), 5),
                         "per_block_ms": round(1000 * step_s / blocks, 3),
                         "gb_per_s": round(step_bytes / step_s / 1e9, 2), "speedup": round(base / step_s, 3)})
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [str(r["verify_threads"]) if r["verify_threads"] else "copy only" for r in rows]
    ax.bar(xs, [r["per_block_ms"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["per_block_ms"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set(xlabel="verify threads (1: the loader thread alone; copy only: nothing verified)",
           ylabel="ms per block (loader, no compute)",
           title=f"row loader, {meta['blocks']} blocks of {meta['tokens']}x{meta['dim']} {meta['dtype']}, "
                 f"{meta['device']}")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=57, help="blocks in a step (FLUX.1: 19 dual + 38 single)")
    ap.add_argument("--tokens", type=int, default=4096, help="rows a block holds (FLUX.1 at 1024²: 4096)")
    ap.add_argument("--dim", type=int, default=3072, help="row width (FLUX.1: 3072)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="verify thread counts, the first the baseline (default: 1 2 4 8, up to the cores)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="default: results/loader_<device>.json")
    args = ap.parse_args(argv)
    cores = usable_cores()  # as the loader sizes its pool
    threads = args.threads or [n for n in (1, 2, 4, 8) if n <= cores]
    dtype = getattr(torch, args.dtype)
    load = os.getloadavg()[0]
    rows = run(args.blocks, args.tokens, args.dim, dtype, args.device, threads, args.reps)
    slug = device_slug(args.device)
    meta = {"device": slug, "gpu": torch.cuda.get_device_name() if slug != "cpu" else None, "dtype": args.dtype,
            "blocks": args.blocks, "tokens": args.tokens, "dim": args.dim, "cores": cores,
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "reps": args.reps,
            "xxhash": xxhash.VERSION,  # one-shot hashing releases the GIL from 3.0 on: the threads' premise
            "load_average_before": round(load, 2), "load_average_after": round(os.getloadavg()[0], 2)}
    out = args.out or RESULTS / f"loader_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, meta, out.with_suffix(".png"))
    print("| verify threads | ms per block | step s | loader thread s | GB/s | vs 1 |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['verify_threads'] or '0 (copy only)'} | {r['per_block_ms']:.2f} | {r['step_s']:.3f} | "
              f"{r['loader_thread_s']:.3f} | {r['gb_per_s']:.2f} | {r['speedup']:.2f} |")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
