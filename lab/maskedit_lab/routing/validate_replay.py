"""The simulator's side of ``maskedit-router-validate``: replay a measured two-instance run (its burst and each
policy's run, same arrivals, templates and token masks) in ``sim`` with the calibration measured around it,
and compare simulated with measured P50/P95 and saturation throughput. A row per simulator variant:
"plain" (workers only denoise, at the speed measured alone; pre/post-processing adds its measured time),
"shared_cpu" (both instances' denoise loops and their single pre-processing and decoding instances share the
host's cores: ``sim_cluster.HostModel``), both with the calibration before the run; "shared_cpu_bracketed" (the
headline) with the mean of the calibrations before and after it, "shared_cpu_calibrated_after" with the one after;
"shared_cpu_bracketed_host_load" (runs measured with ``HostSampler``) the headline plus the CPU the host spent
outside the two instances during the run (the harness, the router, anything else), so a disturbance the instances
did not cause is told apart from a modelling error; "shared_cpu_pooled" with one calibration from all of the
measurement's probes (``pooled``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from maskedit_common.cost_model import CostModel
from maskedit_common.settings import load_settings
from maskedit_router.placement.features import EditFeatures
from maskedit_router.placement.policies import Estimator, Policy

from ..harness.host_sampler import FOREIGN_TOP
from .sim_cluster import HostModel, replay

WARMUP_GAP_S = 30.0  # warm-up requests run one at a time; in the simulator they are this far apart
# The harness's probe templates: the j-th calibration registers template ``base + j`` through the router and its
# interference probe ``base + j + INTERFERENCE_OFFSET`` on both instances directly. Files without
# ``meta.probe_templates`` used base 900, which collided with runs' "fresh" templates (``template + 100 * k``).
OLD_PROBE_BASE = 900
INTERFERENCE_OFFSET = 1000


@dataclass
class ScaledEstimator(Estimator):
    """Service times of this set-up: the profile's prediction times the measured speed ratio, per kind."""

    hit_scale: float = 1.0
    miss_scale: float = 1.0

    def request_ms(self, f: EditFeatures, cached: bool) -> float:
        return super().request_ms(f, cached) * (self.hit_scale if cached else self.miss_scale)


def saturation_throughput(done_s: list[float]) -> float:
    """Completions per second between the first and the last quarter of a burst's completions (leaves out the
    start, when the batches fill, and the drain, when one instance may already be idle)."""
    t = sorted(done_s)
    a, b = len(t) // 4, len(t) - 1 - len(t) // 4
    return (b - a) / (t[b] - t[a])


def background(samples: list[dict], calibrated: float = 0.0) -> tuple[tuple[float, float], ...]:
    """A run's ``HostSampler`` record as ``HostModel.background`` steps: each sample's foreign CPU from the sample
    before it (a sample covers the interval up to its ``t``), less ``calibrated``, the foreign CPU the calibration
    was measured under (its speed ratios include that much already; never below 0)."""
    return tuple((prev, max(0.0, s["foreign_cores"] - calibrated)) for prev, s in
                 zip([samples[0]["t"] - 1.0] + [s["t"] for s in samples[:-1]], samples)) if samples else ()


def _variants(meta: dict, calib: dict, cost: CostModel) -> list[tuple]:
    """(name, service estimator, host model, seconds added outside denoising) per simulator variant."""
    service = ScaledEstimator(cost, hit_scale=calib["hit_scale"], miss_scale=calib["miss_scale"])
    # Shared CPU: the time outside denoising is CPU work split evenly between the pre-processing and decoding
    # instances, which share the host's cores with both denoise loops.
    outside_ms = calib["outside_s"] * 1000
    host = HostModel(cores=meta.get("host_cores", 2), workers_per_host=meta["instances"], pre_ms=outside_ms / 2,
                     post_ms=outside_ms / 2, interference=calib.get("interference", 0.0),
                     interference_full=calib.get("interference_full"),
                     record_ms=meta.get("writes", {}).get("record_ms", 0.0),
                     heal_ms=meta.get("writes", {}).get("heal_ms", 0.0))
    return [("plain", service, None, calib["outside_s"]), ("shared_cpu", service, host, 0.0)]


def _shared_cpu(meta: dict, calib: dict, cost: CostModel) -> tuple:
    """The shared-CPU variant of ``_variants``: (service estimator, host model, seconds added outside denoising)."""
    (_, svc, host, out), = [v for v in _variants(meta, calib, cost) if v[0] == "shared_cpu"]
    return svc, host, out


# A calibration's figures of the host's speed: what combining calibrations (``bracketed``, ``pooled``) combines.
SPEED_FIGURES = ("hit_scale", "miss_scale", "outside_s", "interference", "interference_full", "foreign_cores")


def bracketed(before: dict, after: dict) -> dict:
    """The host's speed over a run from the calibrations on either side of it: their mean (the speed at the run's
    middle if it drifted steadily)."""
    return {**before, **{k: (before[k] + after[k]) / 2 for k in SPEED_FIGURES if k in before and k in after}}


def _lead(meta: dict, run_: dict, key: str) -> list[tuple]:
    """What went through the router before a run's requests, one at a time, as (features, edited tokens or None,
    instance that served it or None): the warm-up and the calibration's probes (a registration, then hits), in the
    order the run sent them (the burst's calibration came first, a policy run's after its warm-up). The probes
    count: they move a stateful policy (round_robin's turn, the template index, the online fit) as they moved the
    real router's."""
    warm = [(_features(meta, w), _bits(w), w.get("instance")) for w in run_["warmup"]]
    calib = run_.get("calibration") or {}
    probes = []
    for i, p in enumerate(calib.get("points", [])):
        # the registration sends an empty mask: the router reads no masked token
        ratio = 0.0 if i == 0 and not p["hit"] else p["mask_ratio"]
        probes.append((EditFeatures(calib.get("key") or f"calib-{key}", ratio, p.get("tokens", 1024),
                                    p.get("steps", meta["steps"])), None, p.get("instance")))
    if run_.get("calibration_shared"):
        probes = []  # this run's calibration was taken before an earlier run
    return probes + warm if key == "saturation" else warm + probes


def _features(meta: dict, r: dict) -> EditFeatures:
    """A measured request's features as the router saw them (its template key, where the measurement saved it)."""
    return EditFeatures(r.get("key") or f"t{r['template']}", r["mask_ratio"], r["tokens"], meta["steps"])


def _replayed(meta: dict, run_: dict, key: str) -> tuple[list[tuple], list | None, int, list | None]:
    """The arrivals a replay sends (the run's lead, ``WARMUP_GAP_S`` apart before time 0, then its requests at
    their times), each arrival's edited tokens (None where unknown; None for all in files without them), how many
    lead, and the instance index that served each arrival (None where the file cannot say)."""
    lead = _lead(meta, run_, key)
    arrivals = [(-WARMUP_GAP_S * (len(lead) - i), f) for i, (f, _, _) in enumerate(lead)] + \
        [(r["t"], _features(meta, r)) for r in run_["requests"]]
    masks = [m for _, m, _ in lead] + [_bits(r) for r in run_["requests"]]
    if all(m is None for m in masks):
        masks = None
    order = (run_.get("calibration") or meta.get("calibration") or {}).get("instances") or []
    served = [i for _, _, i in lead] + [r.get("instance") for r in run_["requests"]]
    routes = [order.index(i) for i in served] if order and all(i in order for i in served) else None
    return arrivals, masks, len(lead), routes


def held_before(meta: dict, runs: list[dict], i: int) -> dict[str, list]:
    """Worker name -> template keys of run ``i`` whose entries its instance already held, clean, before the run's
    requests: templates the harness's probes registered (the calibrations up to run ``i``'s own) that the run
    reuses. Only files whose probe numbering collides with run templates have any; a replay that starts every
    run's stores empty simulates those templates' first requests as template runs where the real ones hit."""
    base = meta.get("probe_templates", OLD_PROBE_BASE)
    order = (runs[i].get("calibration") or meta.get("calibration") or {}).get("instances") or []
    names = meta.get("backends") or [f"w{k}" for k in range(meta["instances"])]
    if len(order) != len(names):
        return {}
    keys = {r["template"]: r["key"] for r in runs[i]["warmup"] + runs[i]["requests"] if r.get("key")}
    taken = [meta.get("saturation", {}).get("calibration") or meta.get("calibration")] + \
        [r.get("calibration") for r in runs[:i + 1] if not r.get("calibration_shared")]
    held: dict[str, list] = {n: [] for n in names}
    for j, calib in enumerate(c for c in taken if c):
        routed = {p.get("instance") for p in calib.get("points", [])[:1]}
        for template, where in ((base + j, routed), (base + j + INTERFERENCE_OFFSET, set(order))):
            if template in keys:
                for inst in where & set(order):
                    held[names[order.index(inst)]].append(keys[template])
    return {n: k for n, k in held.items() if k}


def _held(measured: dict, i: int) -> dict[str, list]:
    """What run ``i``'s replay starts from: the entries its run found (``held_before``), unless the file says to
    start every replay's stores empty."""
    meta = measured["meta"]
    return {} if meta.get("replay_empty_stores") else held_before(meta, measured["runs"], i)


class MeasuredRouting(Policy):
    """Sends each arrival where the measured run's router sent it: a replay with it checks the simulated instances
    and host alone, apart from how the simulated policy routes."""

    name = "measured_routing"

    def __init__(self, routes: list[int]):
        self.routes = iter(routes)

    def choose(self, backends, f, now=None):
        return backends[next(self.routes)]


def _bits(r: dict) -> np.ndarray | None:
    """A measured request's edited tokens, if the measurement saved them."""
    if "mask_bits" not in r:
        return None
    return np.unpackbits(np.frombuffer(bytes.fromhex(r["mask_bits"]), np.uint8))[:r["tokens"]].astype(bool)


def profile_scales(calib: dict, est: Estimator, tokens: int, steps: int) -> dict:
    """``calib`` with its speed ratios (observed / profile-predicted denoise time, hits and template runs apart)
    derived again from its probes' measured denoise times against ``est``'s profile. A ratio is relative to the
    profile it was divided by: a measurement replayed with a profile recalibrated since (the bench profile was, on
    a quieter host, after the saved run) must not multiply the new profile's times by the old profile's ratio.
    ``profile_factor``: new ratio / saved ratio (hits), which converts the router's online fit the same way."""
    hit, miss = [], []
    for p in calib.get("points", []):
        f = EditFeatures("calib", p["mask_ratio"], p.get("tokens", tokens), p.get("steps", steps))
        (hit if p["hit"] else miss).append(p["denoise_s"] * 1000 / est.request_ms(f, p["hit"]))
    if not hit or not miss:
        return {**calib, "profile_factor": 1.0}
    out = {**calib, "hit_scale": statistics.median(hit), "miss_scale": statistics.median(miss)}
    out["profile_factor"] = out["hit_scale"] / calib["hit_scale"]
    return out


def _router_estimator(cost: CostModel, run_: dict, profile_factor: float = 1.0) -> Estimator:
    """The simulated router's estimator, starting from the real router's online fit at the run's start (its scale
    converted to the replay's profile)."""
    model = dict(run_.get("router_model", {}))
    if "scale" in model:
        model["scale"] *= profile_factor
    return replace(Estimator(cost), **model)


def replay_cost(meta: dict) -> CostModel:
    """The profile a replay simulates with: the one the measurement was taken against when it saved it, else the
    current profile of that name (its calibrations' ratios are then derived again: ``profile_scales``)."""
    if meta.get("profile_doc"):
        return CostModel.from_json(meta["profile_doc"])
    profile = load_settings().profiles / meta["profile"]
    return CostModel.load_file(profile) if profile.exists() else CostModel.fallback()


def _after(runs: list[dict], i: int, meta: dict) -> dict | None:
    """The calibration measured after run ``i``: the next one taken (runs sharing a calibration took none)."""
    for later in runs[i + 1:]:
        if not later.get("calibration_shared"):
            return later.get("calibration")
    return meta.get("final_calibration")


def calibrations(measured: dict) -> list[dict]:
    """Every calibration the measurement took, once each: the burst's, each run's own (runs sharing one took none),
    the final one."""
    meta, runs = measured["meta"], measured["runs"]
    taken = [(meta.get("saturation") or {}).get("calibration"), meta.get("calibration"),
             *[r.get("calibration") for r in runs if not r.get("calibration_shared")], meta.get("final_calibration")]
    out = []
    for c in taken:
        if c and all(c is not o for o in out):
            out.append(c)
    return out


def pooled(calibs: list[dict]) -> dict:
    """One calibration from all of a measurement's: their probes pooled (``profile_scales`` then takes the speed
    ratios' medians over all of them) and the median of each other figure. Each calibration has 7 probes, and
    back-to-back calibrations on the quiet host differed by up to 20 % in hit speed (1.66-2.04), which queueing
    near saturation turns into a much larger P95 error. A host with no drift (``HostSampler``: foreign CPU flat)
    has one speed, best estimated from every probe. On the committed measurements it did no better than a run's
    own calibration (docs/router.md): the calibrations' noise is not what the misses are."""
    out = {**calibs[0], "points": [p for c in calibs for p in c.get("points", [])]}
    for k in SPEED_FIGURES:
        got = [c[k] for c in calibs if c.get(k) is not None]
        if got:
            out[k] = statistics.median(got)
    return out


def _scaling(measured: dict) -> tuple[CostModel, Estimator, Callable[[dict], dict]]:
    """The profile a replay simulates with, the router's estimator on it, and a calibration's speed ratios derived
    again against it (``profile_scales``)."""
    meta, runs = measured["meta"], measured["runs"]
    cost = replay_cost(meta)
    est = Estimator(cost)
    tokens = next((r["tokens"] for r in (meta.get("saturation") or runs[0])["requests"]), 1024)
    return cost, est, lambda c: profile_scales(c, est, tokens, meta["steps"])


def _around(measured: dict, i: int, scaled: Callable[[dict], dict]) -> tuple[dict, dict | None]:
    """Run ``i``'s calibrations, ``scaled``: the one before it and the one after it (None: the last run of a file
    without a final calibration)."""
    meta, runs = measured["meta"], measured["runs"]
    after = _after(runs, i, meta)
    return scaled(runs[i].get("calibration", meta["calibration"])), scaled(after) if after else None


def compare(measured: dict) -> list[dict]:
    """Replay the burst and each measured run in the simulator, each with the calibration measured just before
    it (older files: the one calibration); a row per variant. The simulated workers carry the router's names of the
    real backends (``chwbl`` hashes them) where the measurement saved them; p2c samples from a fixed seed."""
    meta = measured["meta"]
    cost, est, scaled = _scaling(measured)
    runs = measured["runs"]
    sat = meta.get("saturation")
    kw = {"names": meta.get("backends"), "policy_kw": {"seed": 0}}
    rows = []
    base = {"workers": meta["instances"], "validation": True}
    everyone = scaled(pooled(calibrations(measured)))
    if sat:
        policy = sat.get("policy", meta["policy"])
        calib = scaled(sat["calibration"])
        rows.append({**base, "policy": policy, "load": "saturation", "simulated": False, "model": "measured",
                     "throughput": sat["throughput"], "requests": len(sat["requests"])})
        arrivals, masks, n_lead, _ = _replayed(meta, sat, "saturation")
        for model, svc, host, _ in _variants(meta, calib, cost):
            sim = replay(policy, meta["instances"], arrivals, _router_estimator(cost, sat, calib["profile_factor"]),
                         service=svc, host=host, masks=masks, **kw)["requests"][n_lead:]
            thr = saturation_throughput([q.done - q.arrival for q in sim])
            rows.append({**base, "policy": policy, "load": "saturation", "simulated": True, "model": model,
                         "throughput": thr,
                         "throughput_error": round(abs(thr - sat["throughput"]) / sat["throughput"], 3)})
    for i, run_ in enumerate(runs):
        policy = run_.get("policy", meta["policy"])
        ok = [r for r in run_["requests"] if r["error"] is None and r["latency_s"] is not None]
        lat = np.array([r["latency_s"] for r in ok])
        b = {**base, "policy": policy, "rate": run_["rate"], "load": run_["load"]}
        m = {**b, "simulated": False, "model": "measured", "p50_s": float(np.percentile(lat, 50)),
             "p95_s": float(np.percentile(lat, 95)), "mean_s": float(lat.mean()), "requests": len(ok),
             "errors": len(run_["requests"]) - len(ok),
             "cache_hits": sum(bool(r["cache_hit"]) for r in ok)}
        if "loadavg" in run_.get("calibration", {}):
            m["loadavg_before"] = round(run_["calibration"]["loadavg"][0], 2)
        hits = [r for r in ok if r["cache_hit"] and r.get("computed_tokens") is not None]
        if hits:  # tokens hits computed against their own masks' (> 1: the entry held invalid tokens); heals made
            m["computed_over_mask"] = round(sum(r["computed_tokens"] for r in hits) /
                                            max(1.0, sum(r["mask_ratio"] * r["tokens"] for r in hits)), 3)
            m["heals"] = sum(bool(r.get("healed_tokens")) for r in ok)
        if run_.get("host"):  # what the host did besides the instances over the run (``HostSampler``)
            foreign = np.array([x["foreign_cores"] for x in run_["host"]])
            m["foreign_cores_mean"], m["foreign_cores_max"] = round(float(foreign.mean()), 3), float(foreign.max())
            m["tested_cores_mean"] = round(float(np.mean([x["tested_cores"] for x in run_["host"]])), 3)
        in_order = np.array([r["latency_s"] for r in sorted(ok, key=lambda r: r["t"])])
        m["p95_ci"], m["mean_ci"] = block_bootstrap_ci(in_order, _p95), block_bootstrap_ci(in_order, _mean)
        rows.append(m)
        arrivals, masks, n_lead, routes = _replayed(meta, run_, str(i))
        before, after = _around(measured, i, scaled)
        variants = [(*v, None) for v in _variants(meta, before, cost)]
        if after:
            # The host's speed drifts within a run too (older files have no calibration after the last run): the
            # same model with the calibration measured right after the run, and with the two brackets' mean.
            mid = bracketed(before, after)
            variants.append(("shared_cpu_calibrated_after", *_shared_cpu(meta, after, cost), None))
            svc, host, out = _shared_cpu(meta, mid, cost)
            variants.append((HEADLINE, svc, host, out, None))
            if routes is not None:  # the host model alone: every request where the real router sent it
                variants.append((f"{HEADLINE}_measured_routing", svc, host, out, MeasuredRouting(routes)))
            if run_.get("host"):  # the headline with the CPU the host spent outside the instances during the run
                steps_ = background(run_["host"], mid.get("foreign_cores", 0.0))
                variants.append((f"{HEADLINE}_host_load", svc, replace(host, background=steps_), out, None))
        # the host model with one calibration pooled from all of the measurement's
        variants.append((POOLED, *_shared_cpu(meta, everyone, cost), None))
        for model, svc, host, outside_s, fixed in variants:
            sim = replay(policy, meta["instances"], arrivals, _router_estimator(cost, run_, before["profile_factor"]),
                         service=svc, host=host, masks=masks, policy=fixed, held=_held(measured, i), **kw)
            done = [q for q, r in zip(sim["requests"][n_lead:], run_["requests"]) if r["error"] is None and
                    r["latency_s"] is not None]  # the requests measured: each against its own replay
            slat = np.array([q.done - q.arrival + outside_s for q in done])
            if model == f"{HEADLINE}_measured_routing":
                m["worst_window"] = worst_window(run_, sim["requests"][n_lead:])
            rows.append({**b, "simulated": True, "model": model, "p50_s": float(np.percentile(slat, 50)),
                         "p95_s": float(np.percentile(slat, 95)), "mean_s": float(slat.mean()),
                         "requests": len(done), "p95_error": _err(np.percentile(slat, 95), m["p95_s"]),
                         "p50_error": _err(np.percentile(slat, 50), m["p50_s"]),
                         "mean_error": _err(slat.mean(), m["mean_s"]),
                         "misses": sum(q.records for q in done), "heals": sum(q.heals for q in done)})
    return rows


def headline_replay(measured: dict, i: int, host_load: bool = False, **what_if) -> tuple[np.ndarray, dict]:
    """Run ``i`` replayed as ``compare``'s headline (the shared-CPU host with the calibrations either side of it;
    the one before for the last run of a file without a final calibration), its host changed by ``what_if``
    (``HostModel`` fields: ``slowdown``, ``noise_cv``, ``noise_seed``); ``host_load``: with the CPU the host spent
    outside the instances during the run, as the ``_host_load`` variant. The simulated latencies of the requests
    the run measured, in its order, and the CPU the replay's tasks were given over the run, by kind (ms)."""
    meta, runs = measured["meta"], measured["runs"]
    cost, _, scaled = _scaling(measured)
    run_ = runs[i]
    arrivals, masks, n_lead, _ = _replayed(meta, run_, str(i))
    before, after = _around(measured, i, scaled)
    calib = bracketed(before, after) if after else before
    svc, host, outside_s = _shared_cpu(meta, calib, cost)
    if host_load and run_.get("host"):
        what_if = {"background": background(run_["host"], calib.get("foreign_cores", 0.0)), **what_if}
    sim = replay(run_.get("policy", meta["policy"]), meta["instances"], arrivals,
                 _router_estimator(cost, run_, before["profile_factor"]), service=svc, host=replace(host, **what_if),
                 masks=masks, held=_held(measured, i),
                 names=meta.get("backends"), policy_kw={"seed": 0})
    return np.array([q.done - q.arrival + outside_s for q, r in zip(sim["requests"][n_lead:], run_["requests"])
                     if r["error"] is None and r["latency_s"] is not None]), sim["cpu_ms"]


WINDOW_S = 15.0  # a slow episode on this host lasts 15-60 s


def worst_window(run_: dict, sim: list, window_s: float = WINDOW_S, least: int = 5) -> dict | None:
    """Where the simulator (with the real routing, so the host model alone) falls furthest short: per window of
    ``window_s`` of arrivals with at least ``least`` requests, the median of measured / simulated denoise time; the
    worst window with the host's samples over it (CPU of the instances, and outside them), beside the run's median.
    A slow window with the foreign CPU up is a disturbance; one with it flat is the model's."""
    rq = [(r, q) for r, q in zip(run_["requests"], sim) if r["error"] is None and r.get("denoise_s")
          and q.denoised is not None and q.denoised > q.started]
    if not rq:
        return None
    ratio = np.array([r["denoise_s"] / (q.denoised - q.started) for r, q in rq])
    win = np.array([int(r["t"] // window_s) for r, _ in rq])
    cells = [(w, float(np.median(ratio[win == w]))) for w in sorted(set(win)) if (win == w).sum() >= least]
    if not cells:
        return None
    w, worst = max(cells, key=lambda c: c[1])
    out = {"t0_s": w * window_s, "t1_s": (w + 1) * window_s, "denoise_ratio": round(worst, 3),
           "run_denoise_ratio": round(float(np.median(ratio)), 3), "requests": int((win == w).sum())}
    # the tokens the window's hits computed, measured and simulated: the same work run slower (the host), or more
    # work (the simulated entries' invalid tokens diverged from the real ones)
    hits = [(r, q) for (r, q), v in zip(rq, win) if v == w and r.get("cache_hit") and
            r.get("computed_tokens") is not None and q.computed is not None]
    if hits:
        out["hit_tokens_measured"] = sum(r["computed_tokens"] for r, _ in hits)
        out["hit_tokens_simulated"] = sum(q.computed for _, q in hits)
        out["hit_tokens_masked"] = int(round(sum(r["mask_ratio"] * r["tokens"] for r, _ in hits)))
    # the denoise loop's CPU over its steps' wall time (EDIT_INFO's steps_cpu_s / steps_wall_s), the window's and
    # the run's: a lower share in the window is time waiting for a core, the same share with slower steps is
    # slower compute
    timed = [(r, v) for (r, _), v in zip(rq, win) if r.get("steps_wall_s")]
    if any(v == w for _, v in timed):
        out["steps_cpu_share"] = _cpu_share([r for r, v in timed if v == w])
        out["run_steps_cpu_share"] = _cpu_share([r for r, _ in timed])
    # samples cover the second before their t; the window's requests run a few seconds past their arrivals
    host = [x for x in run_.get("host", []) if w * window_s < x["t"] <= (w + 1) * window_s + 5.0]
    if host:
        out["foreign_cores"] = round(float(np.mean([x["foreign_cores"] for x in host])), 3)
        out["tested_cores"] = round(float(np.mean([x["tested_cores"] for x in host])), 3)
        out["run_foreign_cores"] = round(float(np.mean([x["foreign_cores"] for x in run_["host"]])), 3)
        who: dict[str, float] = {}  # what the foreign CPU was, averaged over the window (samples that name it)
        for x in host:
            for k, v in x.get("foreign_top", {}).items():
                who[k] = who.get(k, 0.0) + v / len(host)
        if who:
            out["foreign_top"] = {k: round(v, 3) for k, v in
                                  sorted(who.items(), key=lambda kv: -kv[1])[:FOREIGN_TOP]}
    return out


def _cpu_share(requests: list[dict]) -> float:
    """The denoise loop thread's CPU time over the wall time of the steps these requests were in."""
    return round(sum(r["steps_cpu_s"] for r in requests) / sum(r["steps_wall_s"] for r in requests), 3)


BLOCK = 20  # requests per bootstrap block: an arrival episode (a burst that queues) spans about this many


def block_bootstrap_ci(lat: np.ndarray, stat, block: int = BLOCK, n: int = 1000, seed: int = 0,
                       level: float = 0.95) -> list[float]:
    """Confidence interval of ``stat`` (a function of an array, along axis 1) over one run's latencies in arrival
    order: a moving-block bootstrap (resamples of consecutive ``block``-request stretches), because requests that
    arrive together queue together; an i.i.d. bootstrap would treat one slow episode's 20 requests as 20 independent
    draws and give intervals 2-3x too narrow."""
    lat = np.asarray(lat, float)
    block = max(1, min(block, len(lat)))
    starts = np.random.default_rng(seed).integers(0, len(lat) - block + 1, size=(n, -(-len(lat) // block)))
    sample = lat[(starts[:, :, None] + np.arange(block)).reshape(n, -1)[:, :len(lat)]]
    return [round(float(x), 3) for x in np.quantile(stat(sample), [(1 - level) / 2, (1 + level) / 2])]


def _p95(a: np.ndarray) -> np.ndarray:
    return np.percentile(a, 95, axis=-1)


def _mean(a: np.ndarray) -> np.ndarray:
    return a.mean(axis=-1)


def _err(sim: float, measured: float) -> float:
    return round(abs(float(sim) - measured) / measured, 3)


HEADLINE = "shared_cpu_bracketed"
POOLED = "shared_cpu_pooled"  # the host model with one calibration from all of the measurement's (``pooled``)


def ranking(rows: list[dict], model: str = HEADLINE, tolerance: float = 0.15) -> list[dict]:
    """Per load: the policies ordered by measured P95 and by simulated P95 (``model``), whether the orders agree
    (Kendall's tau over the pairs: 1 when every pair is ordered alike), and whether every pair the measurement
    itself tells apart is ordered alike: a pair is distinct when the block-bootstrap 95 % intervals of their
    measured P95s (``p95_ci``) do not overlap; files without intervals fall back to P95s more than ``tolerance``
    apart (the simulator's own accuracy target), which counts pairs well inside the measurement's noise (at 200
    requests a run's P95 interval is +-15-60 %). An indistinguishable pair's order is no claim either way."""
    out = []
    for load in sorted({r["load"] for r in rows if r["load"] != "saturation"}):
        meas = {r["policy"]: r["p95_s"] for r in rows if r["load"] == load and r["model"] == "measured"}
        sim = {r["policy"]: r["p95_s"] for r in rows if r["load"] == load and r["model"] == model}
        ps = [p for p in meas if p in sim]
        if len(ps) < 2:
            continue
        pairs = [(a, b) for i, a in enumerate(ps) for b in ps[i + 1:]]
        alike = {(a, b): np.sign(meas[a] - meas[b]) == np.sign(sim[a] - sim[b]) for a, b in pairs}
        ci = {r["policy"]: r.get("p95_ci") for r in rows if r["load"] == load and r["model"] == "measured"}
        if all(ci.get(p) for p in ps):
            distinct = [(a, b) for a, b in pairs if ci[a][0] > ci[b][1] or ci[b][0] > ci[a][1]]
        else:
            distinct = [(a, b) for a, b in pairs if abs(meas[a] - meas[b]) > tolerance * min(meas[a], meas[b])]
        out.append({"load": load, "model": model, "measured": sorted(ps, key=meas.get),
                    "simulated": sorted(ps, key=sim.get),
                    "same_order": sorted(ps, key=meas.get) == sorted(ps, key=sim.get),
                    "kendall_tau": round((2 * sum(alike.values()) - len(pairs)) / len(pairs), 3),
                    "distinct_pairs": len(distinct), "distinct_pairs_alike": bool(all(alike[p] for p in distinct)),
                    "distinct_pairs_misordered": [list(p) for p in distinct if not alike[p]],
                    "misordered": [list(p) for p in pairs if not alike[p]]})
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Measured against simulated (bracketed) P95 per policy and load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r["load"] != "saturation" and r["model"] == "measured"]
    sim = {(r["policy"], r["load"]): r for r in rows if r["model"] == "shared_cpu_bracketed"}
    host = {(r["policy"], r["load"]): r for r in rows if r["model"] == "shared_cpu_bracketed_host_load"}
    labels = [f"{r['policy']}\n{r['load']}" for r in runs]
    x = np.arange(len(runs))
    w = 0.27 if host else 0.4
    at = (-w, 0.0, w) if host else (-w / 2, w / 2)  # each bar's offset from its policy-load's tick
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(runs)), 4.2))
    ax.bar(x + at[0], [r["p95_s"] for r in runs], w, label="measured P95")
    ax.bar(x + at[1], [sim.get((r["policy"], r["load"]), {}).get("p95_s", 0) for r in runs], w,
           label="simulated P95 (shared CPU, bracketed calibration)")
    if host:
        ax.bar(x + at[2], [host.get((r["policy"], r["load"]), {}).get("p95_s", 0) for r in runs], w,
               label="the same plus the host's CPU outside the instances")
    for i, r in enumerate(runs):
        err = sim.get((r["policy"], r["load"]), {}).get("p95_error")
        if err is not None:
            ax.text(i, max(r["p95_s"], sim[(r["policy"], r["load"])]["p95_s"]) * 1.02, f"{err:.0%}", ha="center",
                    fontsize=8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set(ylabel="P95 latency (s)")
    ax.set_title("Router on 2 Triton instances (bench-flux-fill, CPU float32):\nmeasured vs simulated P95 per policy",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
