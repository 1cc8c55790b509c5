"""perf_analyzer against the ``edit`` ensemble: input data and a streaming run that saves its report.

perf_analyzer comes from the ``tritonclient==2.50.0`` wheel (newer builds need a newer glibc than this
machine has); it links ``libcudart.so.12`` (pip ``nvidia-cuda-runtime-cu12``) and Debian's libb64.

    python -m maskedit.perf_analyzer make-input          # rewrite perf_profiles/edit_input.json
    python -m maskedit.perf_analyzer run                 # start a server, run, save perf_profiles/reports/
    python -m maskedit.perf_analyzer run --url HOST:PORT # against a running server (or the router)
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from . import samples
from .settings import REPO_ROOT

PROFILES = REPO_ROOT / "perf_profiles"
INPUT_FILE = PROFILES / "edit_input.json"
PROMPTS = ["a yellow sun hat", "a mountain lake with pine trees", "a green jacket and white trousers"]


def _b64(img, fmt: str = "PNG") -> str:
    """perf_analyzer's ``b64`` content for a BYTES tensor is the serialized tensor: 4-byte length + bytes."""
    from PIL import Image

    buf = io.BytesIO()
    (img if isinstance(img, Image.Image) else Image.fromarray(img)).save(buf, format=fmt)
    raw = buf.getvalue()
    return base64.b64encode(struct.pack("<I", len(raw)) + raw).decode()


def make_input(path: Path = INPUT_FILE) -> Path:
    """Three real edit requests (template, mask of 5/20/40%, prompt) in perf_analyzer's JSON format."""
    tpl = samples.template()
    tpl_b64 = _b64(tpl, "JPEG")  # templates usually arrive as JPEG; masks as PNG
    data = []
    for i, (shape, ratio) in enumerate([("box", 0.05), ("blob", 0.2), ("person", 0.4)]):
        data.append({
            "TEMPLATE": {"b64": tpl_b64},
            "MASK": {"b64": _b64(samples.mask(*tpl.size, ratio, shape, seed=7))},
            "PROMPT": [PROMPTS[i]],
            "SEED": [i],
        })
    path.write_text(json.dumps({"data": data}))
    return path


def perf_analyzer_env() -> dict:
    env = dict(os.environ)
    site = Path(sysconfig.get_paths()["purelib"])
    libs = [site / "nvidia" / "cuda_runtime" / "lib"]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, libs), env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return env


def binary() -> str:
    exe = Path(sys.executable).parent / "perf_analyzer"
    return str(exe) if exe.exists() else (shutil.which("perf_analyzer") or "perf_analyzer")


def command(url: str, report: Path, concurrency: str = "1:2", interval_ms: int = 4000,
            input_file: Path = INPUT_FILE, model: str = "edit", request_count: int | None = None,
            stability_pct: float = 50) -> list[str]:
    """``request_count``: measure windows of that many requests instead of time windows (steadier when the
    machine is shared with other work, as in CI). ``stability_pct``: how far a window's throughput and latency may
    lie from the last windows' mean before perf_analyzer calls the measurement stable (it fails after
    ``--max-trials`` unstable windows)."""
    window = (["--measurement-mode", "count_windows", "--measurement-request-count", str(request_count)]
              if request_count else ["--measurement-interval", str(interval_ms)])
    return [
        binary(), "-m", model, "-u", url, "-i", "grpc", "--streaming", "--input-data", str(input_file),
        "--concurrency-range", concurrency, *window,
        "--stability-percentage", str(stability_pct), "--max-trials", "6", "-f", str(report), "--verbose-csv",
    ]


def run(url: str, report: Path, **kw) -> subprocess.CompletedProcess:
    report.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command(url, report, **kw), env=perf_analyzer_env(), capture_output=True, text=True,
                          timeout=900)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("make-input")
    r = sub.add_parser("run")
    r.add_argument("--url", help="gRPC host:port of a running server; default: start one")
    r.add_argument("--concurrency", default="1:2")
    r.add_argument("--interval-ms", type=int, default=4000)
    r.add_argument("--report", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "make-input":
        print(f"wrote {make_input()}")
        return
    report = args.report or PROFILES / "reports" / f"edit_{time.strftime('%Y%m%d-%H%M%S')}.csv"
    if args.url:
        proc = run(args.url, report, concurrency=args.concurrency, interval_ms=args.interval_ms)
    else:
        from .launcher import TritonServer

        with TritonServer(log_path=report.with_suffix(".server.log")) as server:
            proc = run(server.grpc_url, report, concurrency=args.concurrency, interval_ms=args.interval_ms)
    print(proc.stdout)
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        raise SystemExit(proc.returncode)
    report.with_suffix(".txt").write_text(proc.stdout)
    print(f"report: {report} (+ .txt with perf_analyzer's summary)")


if __name__ == "__main__":
    main()
