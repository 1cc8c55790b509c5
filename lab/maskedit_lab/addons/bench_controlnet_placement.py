"""`python -m maskedit_lab.addons.bench_controlnet_placement`: the per-step cost of placing ControlNets in their own
Triton model (``MASKEDIT_CONTROLNET_PLACEMENT=triton``, residuals through BLS) against running them in the denoiser's
process, side by side in one run on one model: a tritonserver with placement ``triton`` and a ``LocalEditor``
(in-process) in this process, the same edits alternating in each round after a warm-up. Per case it reports the
ControlNet time per step on each side (EDIT_INFO ``control_s`` / the job's ``control_s``, over the steps), the BLS round
trip and the controlnet model's own work in it (``control_model_s``), and the denoise time per step; the BLS overhead
per step is the round trip minus the model's work. On a CPU the controlnet model's process competes with the denoiser
for the same cores. Writes JSON and a plot under ``perf_profiles/results``.

Flux presets (``--preset flux-cn-tiny`` / ``flux-cn-bench``; default output ``controlnet_placement_flux.json``) also
report what the overlap can hide at most: the transformer's work before it first needs the residuals (embeddings,
rotary tables, the first double block), timed per step in the in-process runs (``overlappable_step_s``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from maskedit import samples
from maskedit.families import family_for
from maskedit.imaging import encode_png
from maskedit.launcher import TritonServer
from maskedit.local import LocalEditor
from maskedit.settings import load_settings

from .bench_controlnet import CASES, RESULTS


class _BeforeResiduals:
    """Times a Flux transformer's calls from their start to the end of the first double block: the work that runs
    before the residuals are needed (what the controlnet model placement overlaps with the calls)."""

    def __init__(self, transformer):
        self.times, self._t0 = [], None
        self.handles = [transformer.register_forward_pre_hook(self._start),
                        transformer.transformer_blocks[0].register_forward_hook(self._end)]

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _end(self, *_):
        if self._t0 is not None:
            self.times.append(time.perf_counter() - self._t0)
            self._t0 = None

    def take(self) -> list[float]:
        out, self.times = self.times, []
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def run(model_dir: Path, steps: int, reps: int, log: Path) -> list[dict]:
    from maskedit_client import EditClient

    s = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": "cpu"})
    size = s.resolution
    tpl, mask = samples.template(size, size, seed=1), samples.mask(size, size, 0.25, "box", seed=1)
    ctl = [samples.template(size, size, seed=7), samples.template(size, size, seed=8)]
    server = TritonServer(log_path=log, env={"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_DEVICE": "cpu",
                                             "MASKEDIT_CONTROLNET_PLACEMENT": "triton", "MASKEDIT_CACHE": "off"})
    server.start(timeout=600)
    client, ed = EditClient(server.grpc_url), LocalEditor(s)
    flux = hasattr(ed.runner.transformer, "transformer_blocks")
    before = _BeforeResiduals(ed.runner.transformer) if flux else None
    # Flux also runs the base edit (no control) on both sides: the server's step without ControlNets, for reference
    cases = {k: v for k, v in CASES.items() if v or flux}
    keys = ("inproc_control", "triton_control", "triton_bls", "triton_model", "inproc_denoise", "triton_denoise") + \
        (("overlappable",) if flux else ())
    got = {case: {k: [] for k in keys} for case in cases}
    try:
        for i in range(reps + 1):  # round 0 warms up (loads the ControlNets on both sides)
            for case, controls in cases.items():
                imgs = [encode_png(np.asarray(c)) for c in ctl[:len(controls)]]
                r = client.edit(tpl, mask, "a hat", seed=i, steps=steps, use_cache=False, controls=controls or None,
                                control_images=ctl[:len(controls)])
                if before is not None:
                    before.take()
                _, _, job = ed.edit(encode_png(np.asarray(tpl)), encode_png(mask), "a hat", seed=i, steps=steps,
                                    use_cache=False, controls=controls or None, control_images=imgs)
                if i and before is not None:
                    got[case]["overlappable"].append(statistics.median(before.take()))
                if i:
                    g = got[case]
                    g["triton_control"].append(r.info.get("control_s", 0.0) / steps)
                    g["triton_bls"].append(r.info.get("control_bls_s", 0.0) / steps)
                    g["triton_model"].append(r.info.get("control_model_s", 0.0) / steps)
                    g["triton_denoise"].append(r.info["denoise_s"] / steps)
                    g["inproc_control"].append(job.control_s / steps)
                    g["inproc_denoise"].append((job.finished_at - job.started_at) / steps)
    finally:
        if before is not None:
            before.close()
        ed.close()
        client.close()
        server.stop()
    rows = []
    for case, g in got.items():
        row = {"case": case, "controls": len(cases[case])}
        for k, v in g.items():
            row[f"{k}_step_s"] = round(statistics.median(v), 5)
            row[f"{k}_runs"] = [round(x, 5) for x in v]
        row["bls_overhead_step_ms"] = round(1e3 * statistics.median(  # the round trip beyond the model's own work
            [b - m for b, m in zip(g["triton_bls"], g["triton_model"])]), 2)
        row["control_triton_minus_inproc_step_ms"] = round(
            1e3 * (row["triton_control_step_s"] - row["inproc_control_step_s"]), 2)
        row["denoise_triton_over_inproc"] = round(row["triton_denoise_step_s"] / row["inproc_denoise_step_s"], 3)
        rows.append(row)
    return rows


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = np.arange(len(rows))
    for dx, key, label in ((-0.3, "inproc_control_step_s", "ControlNets in-process"),
                           (-0.1, "triton_control_step_s", "ControlNets via the controlnet model (BLS)"),
                           (0.1, "inproc_denoise_step_s", "whole step, in-process"),
                           (0.3, "triton_denoise_step_s", "whole step, BLS")):
        ax.bar(x + dx, [1e3 * r[key] for r in rows], 0.2, label=label)
    ax.set_xticks(x, [r["case"] for r in rows])
    ax.set_ylabel("ms per denoise step (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sdxl-tiny")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="default: controlnet_placement_sdxl.json, or "
                    "controlnet_placement_flux.json for the Flux presets")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / ("controlnet_placement_flux.json" if args.preset.startswith("flux")
                              else "controlnet_placement_sdxl.json")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        from maskedit.build_model import build

        model_dir = build(Path(tmp) / "model", args.preset)
        family_for(model_dir).build_controlnets(model_dir / "controlnets")
        rows = run(Path(model_dir), args.steps, args.reps, Path(tmp) / "tritonserver.log")
    meta = {"preset": args.preset, "steps": args.steps, "reps": args.reps, "device": "cpu", "dtype": "float32",
            "machine": platform.machine(), "cores": os.cpu_count(),
            "note": "the controlnet model's process and the denoiser share these cores",
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"), f"ControlNet placement, {args.preset}, {args.steps} steps, CPU float32, "
                                            f"{meta['cores']} cores (shared)")
    for r in rows:
        print(f"{r['case']}: ControlNets per step in-process {1e3 * r['inproc_control_step_s']:.1f} ms, via BLS "
              f"{1e3 * r['triton_control_step_s']:.1f} ms (of which the model's work "
              f"{1e3 * r['triton_model_step_s']:.1f} ms): BLS overhead {r['bls_overhead_step_ms']} ms/step; "
              f"whole step {1e3 * r['inproc_denoise_step_s']:.1f} vs "
              f"{1e3 * r['triton_denoise_step_s']:.1f} ms ({r['denoise_triton_over_inproc']}x)"
              + (f"; overlappable (embeddings + first block) {1e3 * r['overlappable_step_s']:.1f} ms/step"
                 if "overlappable_step_s" in r else ""))


if __name__ == "__main__":
    main()
