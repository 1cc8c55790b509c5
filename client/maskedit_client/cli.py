"""`maskedit-edit`: edit one image through a running server.

    maskedit-edit --template photo.jpg --mask mask.png --prompt "a red dress" --out out/result.png
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
    ap.add_argument("--negative-prompt", help="SD 2 / SDXL models: what to steer away from")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME[:SCALE]",
                    help="a LoRA adapter from the server's library (repeat for several), e.g. --lora style:0.8")
    ap.add_argument("--control", action="append", default=[], metavar="NAME[:SCALE[:START:END]][:mode=M][:preprocess=P]",
                    help="a ControlNet from the server's library (repeat for several, each with its --control-image), "
                         "e.g. --control canny:0.8 or --control union:1:0:0.6:mode=depth")
    ap.add_argument("--control-image", action="append", default=[], type=Path, metavar="FILE",
                    help="the control image of each --control, in order (a map, or a photo with preprocess=canny)")
    ap.add_argument("--reference-image", action="append", default=[], type=Path, metavar="FILE",
                    help="in-context edit models (FLUX.2 klein, FLUX.1 Kontext): a reference image the edit "
                    "conditions on beside the template (repeat for several where the model takes them)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--guidance", type=float)
    ap.add_argument("--raw", action="store_true", help="return the model's output without keeping the template")
    # the stock inpainting pipelines' own parameters (docs/api.md, "Diffusers parameters")
    ap.add_argument("--strength", type=float, help="0..1: run the schedule's last steps from the noised template")
    ap.add_argument("--padding-mask-crop", type=int, metavar="PX",
                    help="edit a crop around the mask (this many pixels wider) at the model's size, paste it back")
    ap.add_argument("--guidance-rescale", type=float, help="SDXL: rescale the guided noise prediction (0..1)")
    ap.add_argument("--true-cfg-scale", type=float, help="Flux inpainting: true CFG with --negative-prompt (> 1)")
    ap.add_argument("--output-format", choices=("png", "jpeg", "webp"), help="the result's encoding (default png)")
    ap.add_argument("--output-quality", type=int, help="JPEG / WebP quality, 1..100")
    ap.add_argument("--out", type=Path, default=None, help="default: result.<output format>")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds the edit may take (retries included)")
    ap.add_argument("--connect-timeout", type=float, default=5.0,
                    help="seconds to wait for a first connection before failing with its likely cause")
    ap.add_argument("--deadline-ms", type=int, help="fail fast (DEADLINE_EXCEEDED) if it cannot finish in time")
    ap.add_argument("--temporal", metavar="JSON", help='temporal reuse (step-to-step caching), e.g. '
                    '\'{"policy": "fbcache", "threshold": 0.08}\' or \'{"policy": "steps", "steps": [0, 1, 2, 4, 6]}\'')
    ap.add_argument("--api-key-file", type=Path, help="a file holding the router's API key (sent as 'authorization: "
                    "Bearer <key>'; a file keeps it off the command line)")
    ap.add_argument("--api-key", help="the API key itself (visible in the process list: prefer --api-key-file)")
    ap.add_argument("--ca-file", type=Path, help="TLS: a PEM file of the certificate(s) to trust (the router's CA)")
    args = ap.parse_args(argv)

    try:
        controls = [_control_arg(a) for a in args.control]
    except ValueError as e:
        print(f"error: --control: {e}", file=sys.stderr)
        return 2
    if len(controls) != len(args.control_image):
        print(f"error: {len(controls)} --control but {len(args.control_image)} --control-image: give one image per "
              "control, in order", file=sys.stderr)
        return 2
    for p in (args.template, args.mask, *args.control_image, *args.reference_image):
        if not p.is_file():
            print(f"error: {p} is not a file", file=sys.stderr)
            return 2
    bars: list = []  # the progress bar, made when the first step is reported (nothing is shown before)
    stop = threading.Event()

    def progress(step: int, total: int) -> None:  # step-level progress when the server streams it
        if not bars:
            bars.append(tqdm(total=total, desc="denoising", unit="step"))
        bars[0].n = step
        bars[0].refresh()

    def tick() -> None:  # keep the elapsed time moving while waiting
        while not stop.wait(0.2):
            if bars:
                bars[0].refresh()

    def close_bar(finished: bool) -> None:
        stop.set()
        if bars:
            if finished:  # the last step's progress is the result itself: show N/N
                bars[0].n = bars[0].total
                bars[0].refresh()
            bars[0].close()

    threading.Thread(target=tick, daemon=True).start()
    t0 = time.perf_counter()
    try:
        api_key = args.api_key_file.read_text().strip() if args.api_key_file else args.api_key
        with EditClient(args.url, timeout_s=args.timeout, api_key=api_key, ca_file=args.ca_file,
                        connect_timeout_s=args.connect_timeout) as client:
            result = client.edit(args.template, args.mask, args.prompt, seed=args.seed, steps=args.steps,
                                 guidance=args.guidance, raw_output=args.raw, on_progress=progress,
                                 deadline_ms=args.deadline_ms, negative_prompt=args.negative_prompt,
                                 loras=[_lora_arg(a) for a in args.lora] or None, controls=controls or None,
                                 control_images=list(args.control_image) or None, temporal=args.temporal,
                                 reference_images=list(args.reference_image) or None,
                                 strength=args.strength, padding_mask_crop=args.padding_mask_crop,
                                 guidance_rescale=args.guidance_rescale, true_cfg_scale=args.true_cfg_scale,
                                 output_format=args.output_format, output_quality=args.output_quality)
    except EditError as e:
        close_bar(False)
        text = str(e)  # the server's message already starts with its code (and the field at fault)
        print(f"error: {text}" if text.startswith(e.code) else f"error [{e.code}]: {text}", file=sys.stderr)
        return 1
    except Exception as e:  # connection refused, timeouts: say what and where
        close_bar(False)
        print(f"error: could not edit via {args.url}: {e}", file=sys.stderr)
        return 1
    close_bar(True)
    out = args.out or Path(f"result.{'jpg' if args.output_format == 'jpeg' else args.output_format or 'png'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(result.png)
    print(f"wrote {out} in {time.perf_counter() - t0:.2f}s; {json.dumps(result.info)}")
    return 0


def _lora_arg(text: str) -> tuple[str, float]:
    name, _, scale = text.partition(":")
    return name, float(scale) if scale else 1.0


def _control_arg(text: str) -> dict:
    """``NAME[:SCALE[:START:END]][:key=value ...]`` as one CONTROLS object."""
    parts = text.split(":")
    keyed = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    numbers = [p for p in parts[1:] if "=" not in p]
    if not parts[0] or len(numbers) not in (0, 1, 3):
        raise ValueError(f"{text!r} is not NAME[:SCALE[:START:END]][:mode=M][:preprocess=P]")
    out: dict = {"name": parts[0]}
    for key, value in zip(("scale", "start", "end"), numbers):
        out[key] = float(value)
    unknown = set(keyed) - {"mode", "preprocess"}
    if unknown:
        raise ValueError(f"{text!r}: unknown keys {sorted(unknown)} (mode, preprocess)")
    return {**out, **keyed}


if __name__ == "__main__":
    sys.exit(main())
