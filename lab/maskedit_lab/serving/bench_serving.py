"""`maskedit-bench-serving`: the served system against what users run today, under open-loop load, in one run.

Systems, each a real ``tritonserver`` on the same model, device and dtype, driven by the load generator:
  diffusers   stock Diffusers ``FluxFillPipeline``, one request at a time, in a thin Triton Python model
  cache_off   our service with the activation cache off (continuous batching)
  fcfs        our service, one request at a time, first come first served (cache on)
  static      our service, static batching (cache on)
  service     our service as deployed (cache on; ``priority`` scheduling on a GPU, ``continuous`` on the CPU)
Load: Poisson arrivals at several rates (multiples of the stock baseline's capacity, measured first as the
throughput of a burst), InstGenIE's mask-ratio workloads, Zipf-popular templates (first requests on a template miss and
record). Reported per system and rate: mean / P50 / P95 / P99 latency, throughput, goodput, cache hit rate, errors,
and on a GPU its utilisation and memory (NVML, sampled). Writes JSON and a plot.

    maskedit-bench-serving                                  # CPU, tiny model: a quick end-to-end check
    maskedit-bench-serving --preset flux-dev --device cuda --dtype bfloat16 --steps 8 --blocks 12   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from tqdm import tqdm

from loadgen import records, runner, workload
from maskedit.launcher import TritonServer, server_env
from maskedit.repository import REPOSITORY, write
from maskedit.build_model import build
from maskedit_common.settings import load_settings

from .. import REPO_ROOT
from . import stock

RESULTS = REPO_ROOT / "perf_profiles" / "results"
SYSTEMS = ("diffusers", "cache_off", "fcfs", "static", "service")


def system_env(system: str, device: str) -> dict:
    """Server settings that make ``system`` out of the one service."""
    base = {"MASKEDIT_CACHE": "planner", "MASKEDIT_BATCHING": "priority" if device == "cuda" else "continuous"}
    return {"cache_off": {**base, "MASKEDIT_CACHE": "off"}, "fcfs": {**base, "MASKEDIT_MAX_BATCH": "1"},
            "static": {**base, "MASKEDIT_BATCHING": "static"}, "service": base, "diffusers": {}}[system]


class BaselineClient:
    """The load generator's client interface (``submit`` -> future with ``.info``) over the baseline's plain
    (non-streaming) inference calls."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)

    def submit(self, template: bytes, mask: bytes, prompt: str, seed=None, steps=None, deadline_ms=None,
               on_progress=None) -> Future:
        import numpy as np

        g = self._grpc
        inputs = []
        for name, value, dtype, np_dtype in (("TEMPLATE", template, "BYTES", object), ("MASK", mask, "BYTES", object),
                                             ("PROMPT", prompt.encode(), "BYTES", object),
                                             ("SEED", seed, "INT64", np.int64), ("STEPS", steps, "INT32", np.int32)):
            if value is None:
                continue
            t = g.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=np_dtype))
            inputs.append(t)
        fut: Future = Future()

        def done(result, error):
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(_Result(json.loads(result.as_numpy("EDIT_INFO")[0])))

        self.client.async_infer(stock.MODEL_NAME, inputs, done)
        return fut

    def close(self) -> None:
        self.client.close()


class _Result:
    def __init__(self, info: dict):
        self.info = info


class GpuSampler:
    """Mean GPU utilisation and peak memory while a run goes (NVML); nothing where NVML is absent."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.samples, self.peak_bytes = period_s, [], 0
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML (no GPU, no driver): report nothing rather than fail the benchmark
            self._nvml = None

    def __enter__(self):
        if self._nvml is not None:
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period_s):
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._h).gpu)
            self.peak_bytes = max(self.peak_bytes, self._nvml.nvmlDeviceGetMemoryInfo(self._h).used)

    def __exit__(self, *exc):
        self._stop.set()

    def summary(self) -> dict:
        if not self.samples:
            return {"gpu_util_mean": None, "gpu_mem_peak_gib": None}
        return {"gpu_util_mean": round(statistics.mean(self.samples), 1),
                "gpu_mem_peak_gib": round(self.peak_bytes / 2**30, 2)}


def lab_pythonpath() -> str:
    """The Python backend's import path with this package on it (the baseline's shim imports it)."""
    return os.pathsep.join([server_env()["MASKEDIT_PYTHONPATH"], str(REPO_ROOT / "lab")])


def _server(system: str, env: dict, repo: Path, log_dir: Path) -> TritonServer:
    return TritonServer(repo, env=env, log_path=log_dir / f"{system}.log")


def run(systems=SYSTEMS, preset: str = "tiny", device: str = "cpu", dtype: str = "float32", steps: int = 4,
        requests: int = 16, fractions=(0.5, 1.0, 2.0, 4.0), templates: int = 4, mask_workload: str = "production",
        timeout_s: float = 300.0, model_dir: Path | None = None) -> dict:
    """The benchmark in a temporary directory (stores, rendered repositories, server logs), removed at the end.
    ``model_dir``: where ``preset``'s model is (built there if missing; default ``models/<preset>-flux-fill``)."""
    model_dir = Path(model_dir or REPO_ROOT / "models" / f"{preset}-flux-fill")
    if not (model_dir / "model_index.json").exists():
        build(model_dir, preset)
    tmp = Path(tempfile.mkdtemp(prefix="maskedit-bench-serving-"))
    try:
        return _run(tmp, model_dir, systems, preset, device, dtype, steps, requests, fractions, templates,
                    mask_workload, timeout_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(tmp: Path, model_dir: Path, systems, preset, device, dtype, steps, requests, fractions, templates,
         mask_workload, timeout_s) -> dict:
    common = {"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": device, "MASKEDIT_DTYPE": dtype,
              "MASKEDIT_CACHE_MEM_DIR": str(tmp / "shm"), "MASKEDIT_CACHE_DISK_DIR": str(tmp / "disk")}
    common["MASKEDIT_PYTHONPATH"] = lab_pythonpath()
    kind = "gpu" if device == "cuda" else "cpu"
    ours = REPOSITORY
    if kind == "gpu":
        ours = tmp / "repo_gpu"
        write(ours, "gpu")
    base_repo = tmp / "repo_baseline"
    stock.render(base_repo, kind)
    size = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir)}).resolution
    assets = runner.Assets(size)
    out = {"meta": {"preset": preset, "device": device, "dtype": dtype, "steps": steps, "requests_per_run": requests,
                    "templates": templates, "mask_workload": mask_workload}, "rows": []}
    capacity = None
    for system in tqdm(systems, desc="systems"):
        repo = base_repo if system == "diffusers" else ours
        with _server(system, {**common, **system_env(system, device)}, repo, tmp).start(timeout=600) as server:
            client = BaselineClient(server.grpc_url) if system == "diffusers" else _edit_client(server.grpc_url)
            try:
                warm = workload.poisson(1.0, 2, workload=mask_workload, n_templates=1, steps=steps, seed=99)
                runner.run(client, warm, assets, timeout_s=timeout_s, progress=False)  # loads, compiles, caches
                if capacity is None:  # the stock baseline's (or the first system's) saturation throughput
                    recs, wall = runner.run(client, workload.poisson(1000.0, 4, workload=mask_workload,
                                                                     n_templates=1, steps=steps, seed=98),
                                            assets, timeout_s=timeout_s, progress=False)
                    capacity = max(1e-3, sum(r.latency_s is not None for r in recs) / wall)
                    out["meta"]["capacity_req_s"] = round(capacity, 4)
                    out["meta"]["capacity_from"] = system
                for f in fractions:
                    rate = f * capacity
                    reqs = workload.poisson(rate, requests, workload=mask_workload, n_templates=templates,
                                            steps=steps, seed=int(f * 100))
                    with GpuSampler() as gpu:
                        recs, wall = runner.run(client, reqs, assets, timeout_s=timeout_s, progress=False)
                    s = records.summarize(recs, wall)
                    row = {"system": system, "load": f, "rate": round(rate, 4), **gpu.summary(),
                           **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}}
                    out["rows"].append(row)
                    tqdm.write(json.dumps({k: row[k] for k in ("system", "rate", "mean_s", "p95_s", "throughput",
                                                                "cache_hit_rate", "errors")}))
            finally:
                client.close()
    out["ratios"] = ratios(out["rows"])
    return out


def _edit_client(url: str):
    from maskedit_client import EditClient

    return EditClient(url)


def ratios(rows: list[dict]) -> list[dict]:
    """Per load: the stock baseline's mean and P95 latency over each system's (above 1: we are faster)."""
    base = {r["load"]: r for r in rows if r["system"] == "diffusers"}
    out = []
    for r in rows:
        b = base.get(r["load"])
        if b is None or r["system"] == "diffusers" or not r.get("mean_s") or not b.get("mean_s"):
            continue
        out.append({"system": r["system"], "load": r["load"], "mean_vs_diffusers": round(b["mean_s"] / r["mean_s"], 2),
                    "p95_vs_diffusers": round(b["p95_s"] / r["p95_s"], 2)})
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for system in dict.fromkeys(r["system"] for r in result["rows"]):
        rs = sorted((r for r in result["rows"] if r["system"] == system), key=lambda r: r["rate"])
        x = [r["rate"] for r in rs]
        for ax, key in zip(axes, ("mean_s", "p95_s", "throughput")):
            ax.plot(x, [r[key] for r in rs], marker="o", label=system)
    m = result["meta"]
    for ax, title in zip(axes, ("mean latency (s)", "P95 latency (s)", "throughput (req/s)")):
        ax.set(xlabel="offered rate (req/s)", title=f"{title} — {m['preset']}, {m['device']}, {m['dtype']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="*", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="default: models/<preset>-flux-fill (built if missing)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="per system and rate")
    ap.add_argument("--loads", type=float, nargs="*", default=[0.5, 1.0, 2.0, 4.0],
                    help="offered rates as multiples of the stock baseline's capacity")
    ap.add_argument("--templates", type=int, default=4)
    ap.add_argument("--workload", choices=sorted(workload.WORKLOADS), default="production")
    ap.add_argument("--out", type=Path, default=None, help="default: results/serving_<device>.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    result = run(args.systems, args.preset, args.device, args.dtype, args.steps, args.requests, args.loads,
                 args.templates, args.workload, model_dir=args.model_dir)
    result["meta"]["seconds"] = round(time.time() - t0, 1)
    if args.device == "cuda":
        import torch

        from maskedit.cache.cost_model import device_slug

        result["meta"]["gpu"] = torch.cuda.get_device_name()
        hw = device_slug("cuda")
    else:
        hw = "cpu"
    out = args.out or RESULTS / f"serving_{hw}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    for r in result["ratios"]:
        print(r)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
