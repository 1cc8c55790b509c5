"""Pre-processing's pacing under a flood, before and after ``intake``: one run, both repositories side by side.

``old``: the served repository with ``intake`` removed and Triton's queue policy put back on ``preprocess`` (a
``dynamic_batching`` block holding ``max_queue_size: 16``), whose batcher in Triton 2.51 re-polls every 500 ms
(docs/reliability.md, "In front of pre-processing"). ``new``: the repository as served. Both servers run at once;
each measurement alternates which goes first (old/new, new/old, ...) so host drift falls on both. Per run:

- M1, refusal floods (``--floods``): one edit that keeps pre-processing busy, then N requests at once on the same
  stream, each with a 1 ms DEADLINE_MS, so every one is refused before any work; the gaps between consecutive
  refusals by pre-processing (median, max; those refused on arrival come at once by construction) and the last
  answer's time after its send. Target: new max gap < 0.2 s (old ~0.49 s).
- M2, ``tests/integration/test_flood.py``'s flood (``--flood``, 20 steps): DEADLINE_MS 4x one warm edit measured just
  before on that server; served, refused by source (``overload.backend_source``), answered after bound + slack
  (late), served per second. Target: no late answers, served/s >= old.
- M7, edits at concurrency 1 (``--latency-edits``): P50/P99 latency. Target: the intake hop adds <= ~3 ms.

Writes ``perf_profiles/results/pacing.json`` and a plot beside it; the device (CPU) and dtype (float32, the tiny
model) are named in it, with the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from maskedit import repository, samples
from maskedit.launcher import TritonServer
from maskedit.scratch import run_scratch
from maskedit.settings import REPO_ROOT

from .overload import backend_source, flood

RESULTS = REPO_ROOT / "perf_profiles" / "results"
SYSTEMS = ("old", "new")
ON_ARRIVAL = ("intake_full", "triton_queue")  # refused on arrival, at once by construction: not what is paced
SLOW_GAP_S = 0.2  # a gap between refusals this long is a hand-over that waited (the old batcher's re-poll: 0.5 s)
OLD_POLICY = "dynamic_batching {\n  default_queue_policy {\n    max_queue_size: 16\n  }\n}\n"


def render_old(dest: Path) -> Path:
    """The served repository without ``intake``, Triton's queue policy back on ``preprocess`` (what ran before)."""
    repository.write(dest, "cpu")
    shutil.rmtree(dest / "intake")
    pre = next(m for m in repository.models() if m.name == "preprocess")
    pre = replace(pre, inputs=[t for t in pre.inputs if t.name != repository.INTAKE_INFO.name])
    (dest / "preprocess" / "config.pbtxt").write_text(repository.render_model(pre, "cpu") + OLD_POLICY)
    edit = re.sub(r'    \{\n      model_name: "intake".*?\n    \},\n', "", repository.render_ensemble(), flags=re.S)
    edit = "".join(line for line in edit.splitlines(keepends=True) if '"INTAKE_INFO"' not in line)
    (dest / "edit" / "config.pbtxt").write_text(edit)
    return dest


@contextlib.contextmanager
def _no_collection():
    """The flood's times are taken by this process's callbacks: a garbage collection in a long-lived caller (a whole
    pytest session) pauses them, and that is not the server's pacing."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def refusal_flood(url: str, n: int, template, mask) -> dict:
    """M1: one edit that keeps pre-processing busy, then ``n`` requests at once on the same stream, each with a 1 ms
    DEADLINE_MS: all refused before any work, those that find 16 waiting on arrival (by intake, or the old queue
    policy), the rest when pre-processing reaches them. The gaps are taken between consecutive answers of the
    latter: under the old policy its batcher handed each over ~0.5 s after the last."""
    from maskedit_client import EditClient, EditError
    from maskedit_client.inputs import edit_inputs

    flood_inputs = [edit_inputs(template, mask, "a hat", seed=i, steps=2, deadline_ms=1) for i in range(n)]
    with _no_collection(), EditClient(url, retry=False, timeout_s=120) as c:
        try:  # connected and warm: the timing starts with the flood
            c.edit(template, mask, "a hat", seed=0, steps=2, deadline_ms=1)
        except EditError:
            pass
        blocker = c.submit(template, mask, "a hat", seed=1, steps=2)  # pre-processing busy as the flood arrives
        sent, done, futs = {}, {}, []
        for i, inputs in enumerate(flood_inputs):  # encoded beforehand: they arrive within a few ms
            sent[i] = time.monotonic()
            f = c.submit_inputs(inputs)
            f.add_done_callback(lambda _, i=i: done.__setitem__(i, time.monotonic()))
            futs.append(f)
        texts = []
        for f in futs:
            try:
                f.result(timeout=120)
                texts.append(("ok", ""))
            except EditError as e:
                texts.append((e.code, str(e)))
            except TimeoutError:
                texts.append(("LOST", ""))
        with contextlib.suppress(Exception):
            blocker.result(timeout=120)
        end = time.monotonic() + 5
        while len(done) < n and time.monotonic() < end:  # the last done callbacks
            time.sleep(0.001)
    sources = [backend_source(t) if code != "ok" else "ok" for code, t in texts]
    at_pre = sorted(done[i] for i in done if sources[i] not in ON_ARRIVAL)
    gaps = [b - a for a, b in zip(at_pre, at_pre[1:])] or [0.0]
    return {"n": n, "gap_median_s": round(statistics.median(gaps), 4), "gap_max_s": round(max(gaps), 4),
            # where the pacing shows: each of the old batcher's re-polls left one gap of ~0.5 s
            "slow_gaps_s": [round(g, 4) for g in gaps if g >= SLOW_GAP_S],
            "at_pre_processing": len(at_pre),
            # M3: the excess refused on arrival, from its send
            "on_arrival_max_after_s": round(max((done[i] - sent[i] for i in done if sources[i] in ON_ARRIVAL),
                                                default=0.0), 4),
            "last_after_s": round(max(done[i] - sent[i] for i in done), 3) if done else None,
            "codes": {k: [c for c, _ in texts].count(k) for k in sorted({c for c, _ in texts})},
            "sources": {k: sources.count(k) for k in sorted(set(sources))},
            "all_before_any_work": all("before any work" in t for _, t in texts),
            "texts": sorted({t[:160] for _, t in texts})[:4]}


def deadline_flood(url: str, n: int, steps: int, template, mask) -> dict:
    """M2: ``tests/integration/test_flood.py``'s flood, its bound calibrated on this server just before."""
    from maskedit_client import EditClient

    with EditClient(url, retry=False, timeout_s=300) as c:
        warm = [c.edit(template, mask, "a hat", seed=s, steps=steps).latency_s for s in range(3)]
    one = min(warm[1:])
    bound_s = max(1.5, 4 * one)
    slack_s = max(3.0, bound_s / 2)
    recs, out = flood(url, n, spread_s=0.05, steps=steps, within_s=bound_s + slack_s,
                      deadline_ms=int(bound_s * 1000))
    served = [r.latency_s for r in recs if r.latency_s is not None]
    answered = [r.answered_after_s for r in recs if r.answered_after_s is not None]
    keep = ("sent", "ok", "refused", "deadline_exceeded", "ended_at_bound", "late", "lost", "answered_max_s",
            "refusal_max_s", "refused_by")
    return {"one_edit_s": round(one, 3), "bound_s": round(bound_s, 3), "slack_s": round(slack_s, 3),
            **{k: out[k] for k in keep},
            "served_per_s": round(len(served) / max(answered), 3) if served and answered else 0.0}


def latency(url: str, edits: int, steps: int, template, mask) -> dict:
    """M7: ``edits`` edits one after another (the first, warm-up, not counted)."""
    from maskedit_client import EditClient

    with EditClient(url, timeout_s=300) as c:
        got = [c.edit(template, mask, "a hat", seed=s, steps=steps).latency_s for s in range(edits + 1)][1:]
    return {"edits": edits, "p50_s": round(float(np.percentile(got, 50)), 4),
            "p99_s": round(float(np.percentile(got, 99)), 4)}


def model_cost(url: str, model: str) -> dict | None:
    """M3: Triton's own statistics of ``model`` (C++, no stub involved): compute and queue time per execution, ms
    (None: no such model)."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(url)
    try:
        stats = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
    except Exception:
        return None
    finally:
        c.close()
    n = int(stats.get("execution_count", 0))
    per = lambda key: round(int(stats["inference_stats"][key].get("ns", 0)) / n / 1e6, 3) if n else None  # noqa: E731
    return {"executions": n, "compute_infer_ms": per("compute_infer"), "queue_ms": per("queue")}


def summarize(runs: dict) -> dict:
    """Per system, the medians over runs; old/new ratios where both are there."""
    out = {}
    for system, rows in runs.items():
        s = {}
        for kind in ("refusal_floods", "flood", "latency"):
            items = [r for run in rows for r in (run.get(kind) or [])] if kind == "refusal_floods" else \
                [run[kind] for run in rows if run.get(kind)]
            if kind == "refusal_floods":
                for n in sorted({r["n"] for r in items}):
                    mine = [r for r in items if r["n"] == n]
                    s[f"refusals_{n}"] = {k: round(statistics.median(r[k] for r in mine), 4)
                                          for k in ("gap_median_s", "gap_max_s", "last_after_s")} | {
                        "gap_max_s_worst": max(r["gap_max_s"] for r in mine)}
            elif items:
                keys = ("served_per_s", "ok", "late", "lost") if kind == "flood" else ("p50_s", "p99_s")
                s[kind] = {k: round(statistics.median(r[k] for r in items), 4) for k in keys}
        out[system] = s
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for k, system in enumerate(SYSTEMS):
        rows = [r for run in result["runs"][system] for r in run["refusal_floods"]]
        ns = sorted({r["n"] for r in rows})
        for j, n in enumerate(ns):
            ys = [r["gap_max_s"] for r in rows if r["n"] == n]
            ax.scatter([j + (k - 0.5) * 0.25] * len(ys), ys, s=14, c="C1" if system == "old" else "C0",
                       label=system if j == 0 else None)
        ax.set_xticks(range(len(ns)), [f"{n} at once" for n in ns])
    ax.axhline(0.2, ls="--", c="gray", lw=0.8)
    ax.set(ylabel="largest gap between consecutive refusals (s)",
           title="M1: refusals before any work (1 ms DEADLINE_MS)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    for k, system in enumerate(SYSTEMS):
        lat = [run["latency"] for run in result["runs"][system] if run.get("latency")]
        if lat:
            ax.scatter([k] * len(lat), [r["p50_s"] for r in lat], s=14, c="C1" if system == "old" else "C0")
    ax.set_xticks(range(len(SYSTEMS)), list(SYSTEMS))
    ax.set(ylabel="P50 edit latency (s)", title=f"M7: concurrency 1, {result['steps']} steps, "
           f"{result['device']} {result['dtype']}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(runs: int, floods: list[int], flood_n: int, steps: int, latency_edits: int, log_dir: Path) -> dict:
    template = samples.template(256, 256, seed=0)
    mask = samples.mask(256, 256, 0.3, "box", seed=100)
    out = {s: [] for s in SYSTEMS}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="maskedit-pacing-") as tmp:
        stack.enter_context(run_scratch())
        repos = {"old": render_old(Path(tmp) / "old"), "new": repository.REPOSITORY}
        servers = {}
        for system in SYSTEMS:
            d = Path(tmp) / system
            env = {"MASKEDIT_CACHE_MEM_DIR": str(d / "shm"), "MASKEDIT_CACHE_DISK_DIR": str(d / "disk"),
                   "MASKEDIT_LATENCY_BOUND_S": "600"}
            servers[system] = TritonServer(repos[system], env=env, log_path=log_dir / f"pacing-{system}.log")
            stack.callback(servers[system].stop)
            servers[system].start()
        for i in tqdm(range(runs), desc="runs"):
            order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
            rows = {s: {"refusal_floods": []} for s in SYSTEMS}
            for n in floods:
                for s in order:
                    rows[s]["refusal_floods"].append(refusal_flood(servers[s].grpc_url, n, template, mask))
            if flood_n:
                for s in order:
                    rows[s]["flood"] = deadline_flood(servers[s].grpc_url, flood_n, steps, template, mask)
            if latency_edits:
                for s in order:
                    rows[s]["latency"] = latency(servers[s].grpc_url, latency_edits, steps, template, mask)
            for s in SYSTEMS:
                rows[s]["intake"] = model_cost(servers[s].grpc_url, "intake")  # cumulative since the start
                out[s].append(rows[s])
    return out


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--floods", default="24,48,160", help="refusal floods (M1): requests sent at once, comma-separated")
    ap.add_argument("--flood", type=int, default=48, help="test_flood's flood (M2) size; 0: skip")
    ap.add_argument("--steps", type=int, default=20, help="denoising steps of M2's and M7's edits")
    ap.add_argument("--latency-edits", type=int, default=20, help="M7's edits per run and system; 0: skip")
    ap.add_argument("--result", type=Path, default=RESULTS / "pacing.json")
    ap.add_argument("--logs", type=Path, default=REPO_ROOT / "out" / "pacing")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    floods = [int(x) for x in args.floods.split(",") if x.strip()]
    load_before, started = os.getloadavg(), time.time()
    runs = run(args.runs, floods, args.flood, args.steps, args.latency_edits, args.logs)
    result = {
        "command": "python -m maskedit_lab.reliability.pacing " + " ".join(argv if argv is not None else
                                                                         __import__("sys").argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "commit": _commit(),
        "device": "cpu", "dtype": "float32", "steps": args.steps,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "note": args.note},
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
        "summary": summarize(runs), "runs": runs,
    }
    new, old = result["summary"].get("new", {}), result["summary"].get("old", {})
    result["targets"] = {
        "M1_new_gap_max_below_0.2_s": all(v["gap_max_s_worst"] < 0.2 for k, v in new.items()
                                          if k.startswith("refusals_")),
        "M2_no_late_answers": all(r["flood"]["late"] == 0 and r["flood"]["lost"] == 0 for r in runs["new"]
                                  if r.get("flood")),
        "M2_served_per_s_new_over_old": round(new["flood"]["served_per_s"] / old["flood"]["served_per_s"], 3)
        if new.get("flood") and old.get("flood", {}).get("served_per_s") else None,
        "M7_p50_added_ms": round(1000 * (new["latency"]["p50_s"] - old["latency"]["p50_s"]), 2)
        if new.get("latency") and old.get("latency") else None,
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1))
    plot(result, args.result.with_suffix(".png"))
    print(json.dumps({"summary": result["summary"], "targets": result["targets"]}, indent=1))
    print(f"wrote {args.result} and {args.result.with_suffix('.png')}")


if __name__ == "__main__":
    main()
