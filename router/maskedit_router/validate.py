"""`maskedit-router-validate`: check the router simulator against a real two-instance run.

1. Start two Triton instances serving the benchmark-size model (one denoise thread each: the machine's two
   cores) and the router in front of them.
2. Measure the simulator's inputs on isolated requests through the router, one at a time: how fast this
   set-up denoises relative to the cost-model profile (observed / profile-predicted denoise time, separately
   for template runs and cache hits) and the time a request spends outside denoising (pre/post-processing,
   transport).
3. Warm every template with one request each, then serve an open-loop Poisson workload through the router
   with the project's load generator and record each request's latency.
4. Replay the same requests (warm-up included: same arrival times, templates and mask ratios measured on the
   model's token grid) in the simulator with those inputs, and compare P50/P95.

Writes ``perf_profiles/results/router_validation.json`` and adds the measured and simulated rows to
``router.json`` (``validation: true``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from maskedit.cache.cost_model import CostModel
from maskedit.settings import REPO_ROOT, load_settings

from .features import EditFeatures, mask_ratio
from .policies import Estimator
from .simulate import replay

RESULTS = REPO_ROOT / "perf_profiles" / "results"
WARMUP_GAP_S = 30.0  # warm-up requests run one at a time; in the simulator they are this far apart


@dataclass
class ScaledEstimator(Estimator):
    """Service times of this set-up: the profile's prediction times the measured speed ratio, per kind."""

    hit_scale: float = 1.0
    miss_scale: float = 1.0

    def request_ms(self, f: EditFeatures, cached: bool) -> float:
        return super().request_ms(f, cached) * (self.hit_scale if cached else self.miss_scale)


def _model_dir() -> Path:
    from maskedit.tiny_model import build

    d = REPO_ROOT / "models" / "bench-flux-fill"
    if not (d / "model_index.json").exists():
        build(d, "bench")
    return d


def run(loads=(0.5, 0.75), requests: int = 60, templates: int = 4, policy: str = "predicted", seed: int = 0,
        out_dir: Path | None = None) -> dict:
    from loadgen import runner as lg
    from loadgen import workload
    from maskedit_client import EditClient

    from .cluster import running_cluster

    model_dir = _model_dir()
    settings = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir)})
    res, steps = settings.resolution, settings.steps
    profile = REPO_ROOT / "perf_profiles" / "cost_model_bench-flux-fill.json"
    cost = CostModel.load_file(profile) if profile.exists() else CostModel.fallback()
    assets = lg.Assets(size=res)
    env = {"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_THREADS_MASKED_DENOISE": "1"}
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="maskedit-validate-"))
    rows, calib = [], {}
    with running_cluster(2, out_dir, policy=policy, env=env) as (router, url, _servers):
        with EditClient(url) as client:
            # 2. isolated requests: a template run, then hits at several mask ratios, one at a time.
            est = Estimator(cost)
            hit_r, miss_r, outside = [], [], []
            probe = [workload.Request(0.0, 900, r, "blob", "calibration", seed=i)
                     for i, r in enumerate((0.3, 0.1, 0.2, 0.3, 0.5))]
            for i, q in enumerate(probe):
                mbytes = assets.mask(q)
                ratio, tokens = mask_ratio(mbytes, res)
                t0 = time.perf_counter()
                result = client.submit(assets.template(q.template), mbytes, q.prompt, seed=q.seed).result(600)
                latency = time.perf_counter() - t0
                info = result.info
                f = EditFeatures("calib", ratio, tokens, steps)
                hit = bool(info.get("cache_hit"))
                (hit_r if hit else miss_r).append(info["denoise_s"] * 1000 / est.request_ms(f, hit))
                outside.append(latency - info["denoise_s"] - (info.get("queue_s") or 0.0))
            calib = {"hit_scale": statistics.median(hit_r), "miss_scale": statistics.median(miss_r),
                     "outside_s": statistics.median(outside), "probes": len(probe)}
            service = ScaledEstimator(cost, hit_scale=calib["hit_scale"], miss_scale=calib["miss_scale"])
            mean_hit_s = service.request_ms(EditFeatures("x", 0.19, (res // 16) ** 2, steps), True) / 1000
            for li, load in enumerate(loads):
                rate = round(load * 2 / mean_hit_s, 3)
                reqs = workload.poisson(rate, requests, workload="public", n_templates=templates, zipf_s=1.1,
                                        seed=seed + li)
                reqs = [replace(r, template=r.template + 100 * (li + 1)) for r in reqs]  # fresh templates per load
                # 3. warm-up: each template once, one at a time; then the open-loop run.
                warm = [replace(reqs[[r.template for r in reqs].index(t)], t=0.0)
                        for t in sorted({r.template for r in reqs})]
                for w in warm:
                    client.submit(assets.template(w.template), assets.mask(w), w.prompt, seed=w.seed).result(600)
                records, wall = lg.run(client, reqs, assets, progress=True)
                measured = np.array([r.latency_s for r in records if r.latency_s is not None and r.error is None])
                errors = sum(r.error is not None for r in records)
                # 4. the same arrivals in the simulator (warm-up first, spaced so they run alone).
                feats = lambda r: EditFeatures(f"t{r.template}", *mask_ratio(assets.mask(r), res), steps)  # noqa: E731
                arrivals = [(-WARMUP_GAP_S * (len(warm) - i), feats(w)) for i, w in enumerate(warm)]
                arrivals += [(r.t, feats(r)) for r in reqs]
                sim = replay(policy, 2, arrivals, Estimator(cost), service=service)
                simulated = np.array([q.done - q.arrival + calib["outside_s"] for q in sim["requests"][len(warm):]])
                for kind, lat in (("measured", measured), ("simulated", simulated)):
                    rows.append({"policy": policy, "workers": 2, "rate": rate, "load": load, "simulated": kind == "simulated",
                                 "p50_s": float(np.percentile(lat, 50)), "p95_s": float(np.percentile(lat, 95)),
                                 "mean_s": float(lat.mean()), "requests": int(lat.size), "validation": True,
                                 **({"errors": errors, "wall_s": round(wall, 2)} if kind == "measured" else {})})
                m, s = rows[-2], rows[-1]
                s["p95_error"] = round(abs(s["p95_s"] - m["p95_s"]) / m["p95_s"], 3)
                s["p50_error"] = round(abs(s["p50_s"] - m["p50_s"]) / m["p50_s"], 3)
                print(json.dumps({"load": load, "rate": rate, "measured_p95": round(m["p95_s"], 3),
                                  "simulated_p95": round(s["p95_s"], 3), "p95_error": s["p95_error"],
                                  "measured_p50": round(m["p50_s"], 3), "simulated_p50": round(s["p50_s"], 3),
                                  "errors": errors}), flush=True)
    return {"meta": {"model": "bench-flux-fill", "instances": 2, "denoise_threads": 1, "policy": policy,
                     "requests_per_load": requests, "templates": templates, "workload": "public, Zipf 1.1",
                     "calibration": calib, "profile": profile.name}, "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.75],
                    help="offered load as a fraction of the two instances' all-hit capacity")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--policy", default="predicted")
    ap.add_argument("--out", type=Path, default=RESULTS / "router_validation.json")
    args = ap.parse_args(argv)
    result = run(args.loads, args.requests, policy=args.policy)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    router_json = RESULTS / "router.json"
    if router_json.exists():  # keep the simulation table and the validation rows in one file
        data = json.loads(router_json.read_text())
        data["rows"] = [r for r in data["rows"] if not r.get("validation")] + result["rows"]
        data.setdefault("meta", {})["validation"] = result["meta"]
        router_json.write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
