"""`maskedit-edit`: edit one image through a running server.

    maskedit-edit --template photo.jpg --mask mask.png --prompt "a red dress" --out result.png
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from .client import EditClient, EditError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of Triton (or the router)")
    ap.add_argument("--template", required=True, type=Path)
    ap.add_argument("--mask", required=True, type=Path, help="white = edit")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--guidance", type=float)
    ap.add_argument("--raw", action="store_true", help="return the model's output without keeping the template")
    ap.add_argument("--out", type=Path, default=Path("result.png"))
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--deadline-ms", type=int, help="fail fast (DEADLINE_EXCEEDED) if it cannot finish in time")
    args = ap.parse_args(argv)

    for p in (args.template, args.mask):
        if not p.is_file():
            print(f"error: {p} is not a file", file=sys.stderr)
            return 2
    bar = tqdm(total=None, desc="denoising", unit="step", leave=False)
    stop = threading.Event()

    def progress(step: int, total: int) -> None:  # step-level progress when the server streams it
        bar.total = total
        bar.n = step
        bar.refresh()

    def tick() -> None:  # keep the elapsed time moving while waiting
        while not stop.wait(0.2):
            bar.refresh()

    threading.Thread(target=tick, daemon=True).start()
    t0 = time.perf_counter()
    try:
        with EditClient(args.url, timeout_s=args.timeout) as client:
            result = client.edit(args.template, args.mask, args.prompt, seed=args.seed, steps=args.steps,
                                 guidance=args.guidance, raw_output=args.raw, on_progress=progress,
                                 deadline_ms=args.deadline_ms)
    except EditError as e:
        stop.set()
        bar.close()
        print(f"error [{e.code}{' ' + e.field if e.field else ''}]: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # connection refused, timeouts: say what and where
        stop.set()
        bar.close()
        print(f"error: could not edit via {args.url}: {e}", file=sys.stderr)
        return 1
    stop.set()
    bar.close()
    args.out.write_bytes(result.png)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.2f}s; {json.dumps(result.info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
