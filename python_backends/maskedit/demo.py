"""`make demo`: serve the embedded default model with a real tritonserver and edit a sample template.

Builds the tiny model if missing, writes the example inputs (``samples.write_examples``) to ``out/``, starts
tritonserver on free ports, sends three edits (small, medium and large masks) through the gRPC client, writes
results and a contact sheet to ``out/``, prints the per-request latency and stops the server.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from . import samples
from .launcher import TritonServer
from .scratch import SCRATCH_VARS, run_scratch
from .build_model import main as build_model
from .settings import REPO_ROOT, load_settings

PROMPTS = {"small_box": "a yellow sun hat", "medium_blob": "a mountain lake with pine trees",
           "large_person": "a green jacket and white trousers"}  # one per example mask (samples.EXAMPLE_MASKS)


def contact_sheet(rows: list[tuple[Image.Image, Image.Image, Image.Image, str]]) -> Image.Image:
    w, h = rows[0][0].size
    label_h = 18
    sheet = Image.new("RGB", (3 * w, len(rows) * (h + label_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (tpl, msk, res, label) in enumerate(rows):
        y = i * (h + label_h)
        draw.text((4, y + 3), f"template | mask | result -- {label}", fill="black")
        for j, im in enumerate((tpl, msk.convert("RGB"), res)):
            sheet.paste(im, (j * w, y + label_h))
    return sheet


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--family", default="flux_fill", help="build this family's tiny model if MASKEDIT_MODEL_DIR has none")
    args = ap.parse_args(argv)
    from maskedit_client import EditClient

    settings = load_settings()
    if not (settings.model_dir / "model_index.json").exists():
        print(f"building the tiny {args.family} model in {settings.model_dir}")
        build_model([str(settings.model_dir), "--family", args.family])
    tpl = samples.write_examples(args.out, args.seed)  # template, masks and edges.png: the docs' inputs too

    print("starting tritonserver ...", flush=True)
    t0 = time.perf_counter()
    # Its store (both tiers), cancel markers, admission board and adapter cache in one directory removed at the end:
    # the demo leaves nothing behind but out/.
    with run_scratch(SCRATCH_VARS), TritonServer(log_path=args.out / "tritonserver.log") as server:
        print(f"ready in {time.perf_counter() - t0:.1f}s: gRPC {server.grpc_url}, HTTP {server.http_url}")
        rows, lines = [], []
        with EditClient(server.grpc_url) as client:
            # Warm up, and record the template's activations so the edits below compute only their masks.
            client.register_template(tpl)
            for name, _, _ in tqdm(samples.EXAMPLE_MASKS, desc="edits", unit="edit"):
                prompt = PROMPTS[name]
                m = np.asarray(Image.open(args.out / f"mask_{name}.png"))
                r = client.edit(tpl, m, prompt, seed=args.seed)
                r.image.save(args.out / f"result_{name}.png")
                rows.append((tpl, Image.fromarray(m), r.image.convert("RGB"), f"{name}: {prompt}"))
                i = r.info
                lines.append(f"{name:13s} mask {i['mask_ratio']:5.1%} of tokens  latency {r.latency_s * 1000:7.1f} ms"
                             f"  (preprocess {i['preprocess_s'] * 1000:.1f}, denoise {i['denoise_s'] * 1000:.1f},"
                             f" decode {i['decode_s'] * 1000:.1f} ms, {i['steps']} steps, cache {i['cache']})")
        contact_sheet(rows).save(args.out / "contact_sheet.png")
    print("\n".join(lines))
    print(f"wrote {len(rows)} results and contact_sheet.png to {args.out}; server stopped")


if __name__ == "__main__":
    main()
