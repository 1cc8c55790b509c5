"""The cold load of one LoRA adapter on a backend, the constant the router's cost model charges
(``--lora-load-ms``, ``maskedit_router.placement.policies.LORA_LOAD_MS``).

Seeded random adapters (``maskedit.adapters.build``: ranks 4-64, attention only and attention + MLP) are written
for a model's denoiser into a temporary library; each is loaded cold ``--repeats`` times through the serving path
(``AdapterRuntime.get``: the file's digest, Diffusers' ``lora_state_dict`` and conversion, the hooks attached),
a fresh runtime each time. Writes per adapter the median ms, file and resident bytes, and a fit ms = a + b·MB, to
``perf_profiles/results/lora_load.json`` with a plot beside it.

    python -m maskedit_lab.addons.lora_load --model models/bench-flux-fill
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from maskedit.adapters.build import write_library
from maskedit.adapters.library import AdapterLibrary, ResolvedRef
from maskedit.adapters.runtime import AdapterRuntime
from maskedit.families import family_for
from maskedit_common.settings import load_settings

from .. import REPO_ROOT


def measure(model_dir: Path, repeats: int = 3) -> dict:
    s = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DTYPE": "float32", "MASKEDIT_DEVICE": "cpu"})
    fam = family_for(model_dir)
    denoiser = fam.load_denoiser(s)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_library(model_dir, fam, denoiser, out=tmp)
        lib = AdapterLibrary(tmp)
        for name in lib.names():
            f = lib.file(name)
            times, nbytes = [], 0
            for _ in range(repeats):
                rt = AdapterRuntime(fam, denoiser, AdapterLibrary(tmp))
                t0 = time.perf_counter()
                nbytes = rt.get(ResolvedRef(name, 1.0, f.digest)).nbytes
                times.append((time.perf_counter() - t0) * 1000.0)
            rows.append({"adapter": name, "format": f.format, "file_bytes": f.path.stat().st_size,
                         "resident_bytes": nbytes, "load_ms": round(statistics.median(times), 2),
                         "load_ms_all": [round(t, 2) for t in times]})
    mb = np.array([r["file_bytes"] / 1e6 for r in rows])
    ms = np.array([r["load_ms"] for r in rows])
    b, a = np.polyfit(mb, ms, 1) if len(rows) > 1 else (0.0, float(ms[0]))
    return {"model": model_dir.name, "device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(),
            "repeats": repeats, "rows": rows, "fit": {"ms": round(float(a), 2), "ms_per_mb": round(float(b), 3)},
            "median_load_ms": round(float(np.median(ms)), 2)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["file_bytes"] / 1e6 for r in result["rows"]]
    ax.scatter(xs, [r["load_ms"] for r in result["rows"]])
    for r, x in zip(result["rows"], xs):
        ax.annotate(r["adapter"], (x, r["load_ms"]), fontsize=7)
    grid = np.linspace(0, max(xs) * 1.05, 20)
    ax.plot(grid, result["fit"]["ms"] + result["fit"]["ms_per_mb"] * grid, "--", lw=1)
    ax.set_xlabel("adapter file (MB)")
    ax.set_ylabel("cold load (ms)")
    ax.set_title(f"LoRA cold load, {result['model']}, {result['device']} {result['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "bench-flux-fill")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "perf_profiles" / "results" / "lora_load.json")
    args = ap.parse_args(argv)
    result = measure(args.model, args.repeats)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    for r in result["rows"]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
