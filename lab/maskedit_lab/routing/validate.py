"""`maskedit-router-validate`: check the router simulator against a real two-instance run.

1. Start two Triton instances serving the benchmark-size model (one denoise thread each: the machine's two
   cores) and the router in front of them.
2. Measure the simulator's inputs on isolated requests through the router, one at a time: how fast this
   set-up denoises relative to the cost-model profile (observed / profile-predicted denoise time, separately
   for template runs and cache hits) and the time a request spends outside denoising (pre/post-processing,
   transport); then, addressing the instances directly, how much the two denoise loops slow each other when
   both run (the same work on both at once against alone: shared memory bandwidth and caches, helper threads),
   at batch 1 and with full batches.
3. Measure the set-up's capacity: a burst of requests sent at once (templates warmed first); the throughput
   between the first and last quarter of completions is the saturation throughput. Offered loads are fractions
   of it, so "load 0.85" means 85 % busy on this machine, whatever its speed that day.
4. Per policy (the router's policy switched between runs, every run on fresh templates) and load: warm every
   template with one request each, re-measure step 2 (the host's speed drifts over minutes, and the warm-up may
   have filled the store's memory tier), then serve an open-loop Poisson workload through the router with the
   project's load generator. After the last run, measure step 2 once more. Throughout, the host is sampled once a
   second (``harness.host_sampler``: CPU of the instances' process trees against the rest of the host); each run
   and calibration keeps its samples, so a replay can tell the instances' own slowness from other load.
5. Replay the same requests (warm-up included: same arrival times, templates and mask ratios measured on the
   model's token grid) in the simulator and compare P50/P95; replay the burst too and compare saturation
   throughput. Each run is bracketed by the calibration before it and the one after it (the next run's, or the
   last one).

Writes ``perf_profiles/results/router_validation.json`` (calibrations, every measured request, and the
comparison rows) and adds the rows to ``router.json`` (``validation: true``). ``--from FILE`` re-runs only
step 5 on a saved measurement (``validate_replay``: the simulator variants).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from maskedit_common.cost_model import CostModel
from maskedit_common.settings import load_settings
from maskedit_router.__main__ import default_profile
from maskedit_router.placement.features import EditFeatures, grid_tokens, mask_ratio, mask_tokens
from maskedit_router.placement.policies import POLICIES, Estimator

from .. import REPO_ROOT
from .validate_replay import HEADLINE, INTERFERENCE_OFFSET, compare, plot, ranking, saturation_throughput

RESULTS = REPO_ROOT / "perf_profiles" / "results"
# The health probe (an empty-mask edit) queues behind a burst in the instances' single pre-processing instance; on
# this shared 2-core host that took over the router's default 5 s, the router took a working backend out of rotation
# and re-routed its requests, and the burst measured a tenth of its capacity. This run measures routing, not fault
# detection: a probe gets 30 s.
PROBE_TIMEOUT_S = 30.0


# Probe templates far above the runs' (``template + 100 * k``, a few thousand): a run's "fresh" templates must not
# be ones a calibration registered (base 900 collided: the replay models old files' collisions, ``held_before``).
PROBE_TEMPLATES = 1_000_000


def _model_dir() -> Path:
    from maskedit.build_model import build

    d = REPO_ROOT / "models" / "bench-flux-fill"
    if not (d / "model_index.json").exists():
        build(d, "bench")
    return d


def _calibrate(client, template: int, assets, est: Estimator, res: int, steps: int) -> dict:
    """Isolated requests on a fresh ``template``, one at a time: its registration (a template run with nothing
    edited, so every token of the entry is valid), then hits at several mask ratios. Medians of observed /
    profile-predicted denoise time (hits and template runs apart) and of the time outside denoising and queueing;
    every probe is kept."""
    from loadgen import workload

    probes = [None] + [workload.Request(0.0, template, r, "blob", "calibration", seed=i)
                       for i, r in enumerate((0.02, 0.05, 0.1, 0.2, 0.3, 0.5))]
    hit_r, miss_r, outside, points = [], [], [], []
    for q in probes:
        t0 = time.perf_counter()
        if q is None:
            info = client.register_template(assets.template(template), steps=steps, timeout_s=600).info
            f = EditFeatures("calib", 1.0, grid_tokens(res), steps)
        else:
            mbytes = assets.mask(q)
            f = EditFeatures("calib", *mask_ratio(mbytes, res), steps)
            info = client.submit(assets.template(template), mbytes, q.prompt, seed=q.seed, steps=steps,
                                 on_progress=lambda *_: None).result(600).info  # progress on, as loadgen
        latency = time.perf_counter() - t0
        hit = bool(info.get("cache_hit"))
        ratio = info["denoise_s"] * 1000 / est.request_ms(f, hit)
        (hit_r if hit else miss_r).append(ratio)
        outside.append(latency - info["denoise_s"] - (info.get("queue_s") or 0.0))
        points.append({"mask_ratio": f.mask_ratio, "tokens": f.tokens, "steps": steps, "hit": hit,
                       "computed_tokens": info.get("computed_tokens"), "instance": info.get("instance"),
                       "steps_cpu_s": info.get("steps_cpu_s"), "steps_wall_s": info.get("steps_wall_s"),
                       "denoise_s": info["denoise_s"], "observed_over_profile": ratio, "outside_s": outside[-1]})
    key = template_key(assets, workload.Request(0.0, template, 0.1, "blob", "calibration", steps=steps), res)
    return {"hit_scale": statistics.median(hit_r), "miss_scale": statistics.median(miss_r),
            "outside_s": statistics.median(outside), "probes": len(probes), "points": points, "key": key}


FULL_BATCH = 4  # the engine's max batch: the full-batch interference probe sends this many per instance at once


def _interference(direct: list, template: int, assets, steps: int) -> dict:
    """How much two denoise loops on this host slow each other beyond sharing its cores (memory bandwidth,
    caches, each instance's loader/writer threads): the same work on both instances at once, each addressed
    directly (not through the router), against the same work alone on one. A registration on both at once, then
    per mask ratio a hit alone on the first instance and the same hit on both at once. ``interference`` is the
    median of (denoise time with both busy) / (alone) - 1; every point is kept.

    Then full batches: ``FULL_BATCH`` hits sent at once to the first instance alone, then as many to each instance
    at once. A cached request streams its entry's activations from host memory, so two full batches contend more
    than two single requests (``sim_cluster.HostModel.interference_full``). ``interference_full`` is (mean denoise
    time with both busy) / (alone) - 1. The batch fills as pre-processing hands the requests over (one at a time,
    alike in both phases), so this is a lower bound of the full-batch figure."""
    from concurrent.futures import ThreadPoolExecutor

    from loadgen import workload

    img = assets.template(template)
    points = []
    instances = []
    with ThreadPoolExecutor(len(direct)) as pool:
        def both(fn) -> list[float]:
            rs = list(pool.map(fn, direct))
            instances[:] = [r.info.get("instance") for r in rs]  # which denoise stub each instance is
            return [r.info["denoise_s"] for r in rs]

        alone = direct[0].register_template(img, steps=steps, timeout_s=600).info["denoise_s"]
        pair = both(lambda c: c.register_template(img, steps=steps, timeout_s=600))  # a template run forced on each
        points.append({"mask_ratio": 1.0, "alone_s": alone, "both_s": pair})
        for i, r in enumerate((0.05, 0.2, 0.4)):
            q = workload.Request(0.0, template, r, "blob", "interference", seed=i)
            m = assets.mask(q)
            alone = direct[0].submit(img, m, q.prompt, seed=q.seed, steps=steps).result(600).info["denoise_s"]
            pair = both(lambda c: c.submit(img, m, q.prompt, seed=q.seed, steps=steps).result(600))
            points.append({"mask_ratio": r, "alone_s": alone, "both_s": pair})
    ratios = [statistics.mean(p["both_s"]) / p["alone_s"] for p in points]
    batch = [workload.Request(0.0, template, 0.2, "blob", "interference", seed=10 + i) for i in range(FULL_BATCH)]
    masks = [assets.mask(q) for q in batch]

    def full_batch(client) -> list[float]:
        futures = [client.submit(img, m, q.prompt, seed=q.seed, steps=steps) for q, m in zip(batch, masks)]
        return [f.result(600).info["denoise_s"] for f in futures]

    alone_full = full_batch(direct[0])
    with ThreadPoolExecutor(len(direct)) as pool:
        both_full = list(pool.map(full_batch, direct))
    full = {"batch": FULL_BATCH, "mask_ratio": 0.2, "alone_s": alone_full, "both_s": both_full}
    ratio_full = statistics.mean(x for b in both_full for x in b) / statistics.mean(alone_full)
    return {"interference": max(0.0, statistics.median(ratios) - 1.0), "interference_points": points,
            "interference_full": max(0.0, ratio_full - 1.0), "interference_full_point": full,
            "instances": instances}


def _metrics(servers) -> list[dict[tuple, float]]:
    """Each instance's Triton metrics (its metrics port), keyed by (name, *label values)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for s in servers:
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).read().decode()
        m: dict[tuple, float] = {}
        for family in text_string_to_metric_families(text):
            for x in family.samples:  # summed over the model processes that count the same thing
                key = (x.name, *(v for k, v in x.labels.items() if k not in ("model", "store")))
                m[key] = m.get(key, 0.0) + x.value
        out.append(m)
    return out


def _store_state(servers) -> list[dict]:
    """Each instance's activation store when a calibration starts: bytes per tier, evictions to disk so far. A
    store past its memory budget writes an evicted entry to disk with every insert, so the calibration is taken
    in the store state its run sees."""
    return [{"mem_bytes": m.get(("maskedit_cache_bytes", "mem"), 0.0),
             "disk_bytes": m.get(("maskedit_cache_bytes", "disk"), 0.0),
             "evictions": m.get(("maskedit_cache_events_total", "evictions"), 0.0)} for m in _metrics(servers)]


def _write_costs(servers) -> dict:
    """CPU per background entry write on this host (a template run's entry, a heal's rewrite), from the instances'
    own counters."""
    total: dict[tuple, float] = {}
    for m in _metrics(servers):
        for k, v in m.items():
            total[k] = total.get(k, 0.0) + v
    events, cpu = "maskedit_cache_events_total", "maskedit_cache_write_cpu_seconds_total"
    heals = total.get((events, "heals"), 0.0)
    records = total.get((events, "inserts"), 0.0) - heals  # every heal is an insert too
    return {"records": int(records), "heals": int(heals),
            "record_ms": 1000 * total.get((cpu, "record"), 0.0) / max(1.0, records),
            "heal_ms": 1000 * total.get((cpu, "heal"), 0.0) / max(1.0, heals)}


def _warm(client, assets, reqs) -> list[tuple]:
    """One request per template, one at a time, so every later request on it can hit; (request, the instance that
    served it) each."""
    warm = [replace(reqs[[r.template for r in reqs].index(t)], t=0.0) for t in sorted({r.template for r in reqs})]
    return [(w, client.submit(assets.template(w.template), assets.mask(w), w.prompt, seed=w.seed, steps=w.steps)
             .result(600).info.get("instance")) for w in warm]


def template_key(assets, r, res: int) -> str:
    """The template key the router computes for request ``r`` as loadgen sends it (its hash of the template's
    bytes and the settings that key the cache): a replay hashes templates onto ``chwbl``'s ring as the router did."""
    from tritonclient.grpc._utils import _get_inference_request

    from maskedit_client.inputs import edit_inputs
    from maskedit_router.placement.features import extract

    inputs = edit_inputs(assets.template(r.template), assets.mask(r), r.prompt, seed=r.seed, steps=r.steps,
                         deadline_ms=r.deadline_ms)
    req = _get_inference_request("edit", inputs, "", "", None, 0, False, False, 0, None, None)
    return extract(req, res).template_key
def estimate_wall_s(capacity: float, loads, requests: int, policies: int, calibration_s: float,
                    calibrations: int, warmup_s: float) -> float:
    """Seconds the measured runs will take: each load's requests at its rate, a drain of a few service times, the
    warm-ups and the calibrations (``calibration_s`` each, as the first one took)."""
    runs = policies * len(loads)
    sending = policies * sum(requests / (load * capacity) for load in loads)
    return sending + runs * (warmup_s + 10.0 / capacity) + calibrations * calibration_s


def run(loads=(0.5, 0.7, 0.85), requests: int = 200, templates: int = 4, policies=("predicted",), seed: int = 0,
        burst: int = 48, out_dir: Path | None = None, max_wall_s: float | None = None, steps: int | None = None,
        calibrate_every: str = "run") -> dict:
    """Measure ``policies`` one after another on one pair of instances (the router's policy is switched between
    runs; each run gets fresh templates), every run bracketed by calibrations (``calibrate_every="policy"``: one
    before each policy's first load, shared by its loads). ``steps``: denoising steps per request (default: the
    model's). After ``max_wall_s`` no further policy is started (the ones left are listed in ``meta.skipped``);
    the final calibration still runs."""
    started = time.monotonic()
    skipped = []
    from loadgen import runner as lg
    from loadgen import workload
    from maskedit_client import EditClient
    from maskedit_router.placement.policies import make

    from ..harness.cluster import running_cluster
    from ..harness.host_sampler import HostSampler

    model_dir = _model_dir()
    settings = load_settings({"MASKEDIT_MODEL_DIR": str(model_dir)})
    res, steps = settings.resolution, steps or settings.steps
    profile = default_profile()
    cost = CostModel.load_file(profile) if profile.exists() else CostModel.fallback()
    assets = lg.Assets(size=res)
    # 3 GiB of activation memory tier (RAM) per instance: a load's templates and probes fit (~300 MB an entry),
    # older loads' entries go to disk, and both instances stay well inside this machine's memory.
    env = {"MASKEDIT_MODEL_DIR": str(model_dir), "MASKEDIT_THREADS_MASKED_DENOISE": "1",
           "MASKEDIT_CACHE_MEM_BYTES": str(3 << 30)}
    est = Estimator(cost)

    def feats(r) -> dict:
        """Mask ratio and token count on the model's grid, the edited tokens themselves (packed bits, hex) and the
        router's template key."""
        t = mask_tokens(assets.mask(r), res)
        return {"mask_ratio": float(t.mean()), "tokens": int(t.size), "mask_bits": np.packbits(t).tobytes().hex(),
                "key": template_key(assets, r, res)}

    def warmed(warm) -> list[dict]:
        return [{"template": w.template, **feats(w), "instance": inst} for w, inst in warm]
    runs = []
    probe = itertools.count(PROBE_TEMPLATES)
    with tempfile.TemporaryDirectory(prefix="maskedit-validate-") as tmp, \
            running_cluster(2, Path(out_dir or tmp), policy=policies[0], env=env,
                            health={"probe_timeout_s": PROBE_TIMEOUT_S}) as (router, url, servers):
        with EditClient(url) as client, contextlib.ExitStack() as stack:
            direct = [stack.enter_context(EditClient(s.grpc_url)) for s in servers]
            # the instances' process trees are what the simulator models; the rest of the host's CPU (this
            # harness, the router, anything else) is recorded beside each run
            host = stack.enter_context(HostSampler(lambda: [s.proc.pid for s in servers if s.proc]))

            def measured(reqs) -> tuple:
                """``lg.run`` with the host's samples over it (``t`` from the run's start, as its arrivals)."""
                t0 = time.monotonic()
                records, wall = lg.run(client, reqs, assets, progress=True)
                return records, wall, host.between(t0, time.monotonic())

            def calibrate() -> dict:
                template = next(probe)
                t0 = time.monotonic()
                out = {"store": _store_state(servers), "loadavg": list(os.getloadavg()),
                       **_calibrate(client, template, assets, est, res, steps),
                       **_interference(direct, template + INTERFERENCE_OFFSET, assets, steps)}
                # the CPU outside the instances while calibrating: its speed ratios already include this much
                foreign = [x["foreign_cores"] for x in host.between(t0, time.monotonic())]
                return {**out, "foreign_cores": statistics.mean(foreign) if foreign else 0.0}

            def router_model() -> dict:
                """The router's online fit when a run starts: the simulated router starts from the same."""
                return {"scale": router.est.scale, "error": router.est.error}

            t0 = time.monotonic()
            calib = calibrate()
            calibration_s = time.monotonic() - t0
            # 3. capacity: a burst on warmed templates.
            sat = workload.synthesize(np.zeros(burst), workload="public", n_templates=templates, zipf_s=1.1,
                                      seed=seed + 99)
            sat = [replace(r, template=r.template + 50, steps=steps) for r in sat]
            sat_model = router_model()
            t0 = time.monotonic()
            warm = _warm(client, assets, sat)
            warmup_s = time.monotonic() - t0
            records, wall, sat_host = measured(sat)
            capacity = saturation_throughput([r.done_s for r in records if r.error is None])
            saturation = {"throughput": capacity, "wall_s": round(wall, 2), "calibration": calib, "host": sat_host,
                          "policy": policies[0], "router_model": sat_model, "warmup": warmed(warm),
                          "requests": [{"t": 0.0, "template": r.template, **feats(r), "done_s": rec.done_s,
                                        "cache_hit": rec.cache_hit, "error": rec.error, **rec.extra}
                                       for r, rec in zip(sat, records)]}
            n_calib = 1 + (len(policies) if calibrate_every == "policy" else len(policies) * len(loads))
            eta = estimate_wall_s(capacity, loads, requests, len(policies), calibration_s, n_calib, warmup_s)
            print(json.dumps({"saturation_throughput": round(capacity, 3), "calibration_s": round(calibration_s, 1),
                              "estimated_remaining_min": round(eta / 60, 1)}), flush=True)
            k = 0
            run_calib = None
            for policy in policies:
                if max_wall_s is not None and time.monotonic() - started > max_wall_s:
                    skipped.append(policy)
                    continue
                router.policy = make(policy, router.est)  # the router's defaults, as ``--policy`` builds it
                for li, load in enumerate(loads):
                    k += 1
                    rate = round(load * capacity, 3)
                    reqs = workload.poisson(rate, requests, workload="public", n_templates=templates, zipf_s=1.1,
                                            seed=seed + li, steps=steps)  # every policy: the same arrivals, masks
                    reqs = [replace(r, template=r.template + 100 * k) for r in reqs]  # fresh templates per run
                    model_at_start = router_model()  # before the warm-up, which the simulator replays too
                    warm = _warm(client, assets, reqs)
                    # Right before the run, after the warm-up: the calibration sees the store as the run finds it
                    # (the warm-up's entries can push it past its memory budget: an eviction to disk per insert).
                    # Calibrated once per policy: its later loads share the one before its first load.
                    if li == 0 or calibrate_every == "run":
                        run_calib = calibrate()
                        shared = False
                    else:
                        shared = True
                    records, wall, run_host = measured(reqs)
                    runs.append({
                        "policy": policy, "load": load, "rate": rate, "wall_s": round(wall, 2), "host": run_host,
                        "calibration": run_calib, "calibration_shared": shared, "router_model": model_at_start,
                        "warmup": warmed(warm),
                        "requests": [{"t": r.t, "template": r.template, **feats(r),
                                      "latency_s": rec.latency_s, "queue_s": rec.queue_s, "denoise_s": rec.denoise_s,
                                      "cache_hit": rec.cache_hit, "error": rec.error, **rec.extra}
                                     for r, rec in zip(reqs, records)],
                    })
                    print(json.dumps({"policy": policy, "load": load, "rate": rate, "measured_p95": round(float(
                        np.percentile([r.latency_s for r in records if r.latency_s is not None], 95)), 3),
                        "elapsed_min": round((time.monotonic() - started) / 60, 1)}), flush=True)
            # The host's speed drifts within a run as well: each run is bracketed by the calibration before it
            # and the next one, so the last run needs one after it.
            final_calib = calibrate()
            writes = _write_costs(servers)
            print(json.dumps({"writes": writes}), flush=True)
    return {"meta": {"model": "bench-flux-fill", "instances": 2, "denoise_threads": 1, "policy": policies[0],
                     "policies": [p for p in policies if p not in skipped], "skipped": skipped,
                     "host_cores": os.cpu_count(), "probe_templates": PROBE_TEMPLATES,
                     "loadavg_at_end": list(os.getloadavg()),
                     "steps": steps, "requests_per_load": requests, "templates": templates,
                     "workload": "public, Zipf 1.1", "calibration": calib, "calibrate_every": calibrate_every,
                     "profile": profile.name, "resolution": res,
                     # the router's names of its backends, in server order: a replay's workers carry them
                     "backends": [s.grpc_url for s in servers],
                     # the profile the calibration's ratios are relative to: a replay uses this very profile
                     "profile_doc": json.loads(profile.read_text()) if profile.exists() else None,
                     "load_basis": "measured saturation throughput", "saturation": saturation,
                     "writes": writes, "final_calibration": final_calib,
                     "wall_s": round(time.monotonic() - started, 1)}, "runs": runs}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.7, 0.85],
                    help="offered load as a fraction of the measured saturation throughput")
    ap.add_argument("--requests", type=int, default=200, help="requests per policy and load")
    ap.add_argument("--steps", type=int, help="denoising steps per request (default: the model's, 8 for the "
                    "benchmark model; fewer: shorter service, so the same requests take less wall time)")
    ap.add_argument("--calibrate-every", choices=("run", "policy"), default="run", help="a calibration before "
                    "every policy and load (run), or one per policy shared by its loads (policy: fewer, cheaper)")
    ap.add_argument("--policies", nargs="*", default=list(POLICIES), help="measured one after another on one pair "
                    "of instances, each run bracketed by calibrations")
    ap.add_argument("--burst", type=int, default=48, help="requests of the capacity burst (fewer: a smoke test)")
    ap.add_argument("--max-wall-s", type=float, help="start no further policy after this long (the rest are "
                    "listed as skipped)")
    ap.add_argument("--from", dest="source", type=Path,
                    help="re-simulate the measured runs saved in this file (no cluster)")
    ap.add_argument("--out", type=Path, default=RESULTS / "router_validation.json")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the cluster's servers are stopped on the way
    measured = json.loads(args.source.read_text()) if args.source else run(
        args.loads, args.requests, policies=args.policies, max_wall_s=args.max_wall_s, steps=args.steps,
        calibrate_every=args.calibrate_every, burst=args.burst)
    measured["rows"] = compare(measured)
    measured["ranking"] = ranking(measured["rows"])
    for r in measured["ranking"]:
        print(json.dumps(r))
    for r in measured["rows"]:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                          if k in ("policy", "load", "rate", "model", "p50_s", "p95_s", "p95_error", "p50_error", "mean_error",
                                   "errors", "cache_hits", "throughput", "throughput_error", "computed_over_mask",
                                   "heals", "misses", "foreign_cores_mean", "foreign_cores_max", "worst_window")}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(measured, indent=1))
    router_json = RESULTS / "router.json"
    # keep the simulation table and the claim's validation rows in one file (a result written elsewhere or under
    # another name, a smoke run, a diagnostic run of some policies, an offline replay, leaves the table alone)
    if router_json.exists() and args.out.resolve() == (RESULTS / "router_validation.json").resolve():
        data = json.loads(router_json.read_text())
        data["rows"] = [r for r in data["rows"] if not r.get("validation")] + measured["rows"]
        data.setdefault("meta", {})["validation"] = {k: v for k, v in measured["meta"].items()}
        router_json.write_text(json.dumps(data, indent=1))
    plot(measured["rows"], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
