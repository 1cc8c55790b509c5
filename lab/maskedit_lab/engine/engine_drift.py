"""`python -m maskedit_lab.engine.engine_drift COMMITTED RERUN [...] --out FILE`: how far a rerun of the engine
benchmark (``maskedit-bench-engine``) moved from the committed results, ratio by ratio and mode by mode — the check
that a refactor left the figures where they were. Pairs the files given (committed, rerun, committed, rerun, ...)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def drift(committed: dict, rerun: dict) -> list[dict]:
    old = {(r["mask_ratio"], r["mode"]): r for r in committed["rows"]}
    out = []
    for r in rerun["rows"]:
        o = old.get((r["mask_ratio"], r["mode"]))
        if o is None or r["mode"] == "full":
            continue
        out.append({"preset": rerun["meta"]["preset"], "mask_ratio": r["mask_ratio"], "mode": r["mode"],
                    "speedup_committed": o["speedup"], "speedup_rerun": r["speedup"],
                    "change": round(r["speedup"] / o["speedup"] - 1, 3) if o["speedup"] else None,
                    "ssim_committed": o["ssim"], "ssim_rerun": r["ssim"],
                    "blocks_committed": o["block_modes"], "blocks_rerun": r["block_modes"]})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+", help="committed and rerun result files, in pairs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if len(args.files) % 2:
        ap.error("give the files in pairs: committed, rerun")
    rows = []
    for a, b in zip(args.files[::2], args.files[1::2]):
        rows += drift(json.loads(a.read_text()), json.loads(b.read_text()))
    command = "python -m maskedit_lab.engine.engine_drift " + " ".join(map(str, args.files))
    args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['preset']:11s} {r['mask_ratio']:4.2f} {r['mode']:8s} {r['speedup_committed']:5.2f} -> "
              f"{r['speedup_rerun']:5.2f} ({r['change']:+.0%})  SSIM {r['ssim_committed']:.4f} -> {r['ssim_rerun']:.4f}")


if __name__ == "__main__":
    main()
