"""`python -m maskedit_lab.reliability.faults` (`make faults`): faults under load through the router, each judged by
what every request ended in, whether anything bad was served, and how long until the system was back to full strength.

    python -m maskedit_lab.reliability.faults             # every fault; JSON + plot in perf_profiles/results
    python -m maskedit_lab.reliability.faults --faults corrupt_entry --duration 60

The caches are warmed first (one request per template). Faults (each at a random moment in the first half of its
case, while the load goes on; the storage ones on one backend):
- ``corrupt_entry``: 64 KiB of random bytes written into the middle of the hottest entries of the memory tier, the
  files' times put back (three times, 8 s apart). The service must detect it itself (its ``corrupt`` counter);
  every answered cache hit after the first injection is then checked against the same request with the cache off
  (PSNR): ``corrupt_served`` counts hits that match neither it nor a healthy hit.
- ``corrupt_then_evict``: the same damage to the least recently used entries, the next the churn evicts to the
  disk tier: eviction must discard them (counted), none may reach the disk tier, none be served.
- ``disk_unwritable`` (read-only, then writable): the disk tier read-only for ``--hold`` seconds (a read-only bind
  mount as root, else mode 0555): the memory tier, sampled every 0.2 s, must never exceed its budget, and the tier's
  degraded flag must clear by itself once it is writable again.
- ``mem_fs_full`` (ENOSPC, then the space back): a filesystem smaller than the budget (3 MB; ~2 tiny-model entries)
  mounted over the memory tier (root only) for ``--hold`` seconds: ENOSPC must shrink the budget and keep entries
  coming in and hits coming out, and the budget must grow back once the space returns.
- ``sigstop_router``: the router process stopped for 30 s, then resumed: the clients' requests wait, none is refused
  or failed for it, and no backend leaves rotation.
- ``kill_denoise_stub``: kill -9 of one backend's masked_denoise stub under load: the supervisor reloads that model
  alone, the router retries what it held and takes the backend back.
- ``idle_streams``: 500 idle gRPC streams held open against the router by a client that then dies
  (``fault_streams``): the normal traffic's P95 must stay within 1.5x of a quiet run.

Rows: fault, sent, ok, errors, lost, corrupt_served, recovery_s, hit rate before / after, plus each fault's own
figures. ``recovery_s`` runs from the fault's end (for the stub kill: the kill) until the system is back to full
strength (``full_strength``): every backend in rotation, no store tier flagged degraded in any process, every memory
budget back to its configured size, and the hit rate back (10 requests in a row within 10 % of the rate before).
Targets: 0 lost, 0 corrupt served, recovery_s < 30 s, hit rate after within 10 % of before.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import io
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from loadgen import runner
from maskedit.settings import REPO_ROOT

from . import chaos, fault_streams, full_strength
from .topology import Topology, running_topology

RESULTS = REPO_ROOT / "perf_profiles" / "results"
CORRUPT_BYTES = 64 << 10


# -- helpers --------------------------------------------------------------------------------------------------
def corrupt_file(path: Path, n: int = CORRUPT_BYTES, rng: random.Random | None = None) -> None:
    """``n`` random bytes into the middle of ``path``, its access and modification times put back."""
    st = path.stat()
    rng = rng or random.Random()
    with open(path, "r+b") as f:
        f.seek(max(0, st.st_size // 2 - n // 2))
        f.write(rng.randbytes(min(n, st.st_size)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def store_events(topo: Topology, i: int) -> dict:
    """Backend ``i``'s activation-store counters (all model processes summed) and ``degraded_<tier>`` flags."""
    view = full_strength.store_view(topo, i) or {"events": {}, "degraded": {}}
    return {**view["events"], **{f"degraded_{t}": v for t, v in view["degraded"].items()}}


def _mem_sampler(cache, stop: threading.Event, peaks: dict) -> None:
    mem = Path(cache.mem_dir)
    while not stop.wait(0.2):
        held = 0
        for p in mem.glob("*.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                held += p.stat().st_size
        peaks["mem_peak_bytes"] = max(peaks.get("mem_peak_bytes", 0), held)


@contextlib.contextmanager
def read_only(d: Path):
    """``d`` read-only for the block: a read-only bind mount of itself as root (root ignores modes), else 0555."""
    if os.geteuid() == 0 and subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True).returncode == 0:
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True, capture_output=True)
            yield "read-only bind mount"
        finally:
            for _ in range(50):
                if subprocess.run(["umount", str(d)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
        return
    mode = d.stat().st_mode
    os.chmod(d, 0o555)
    try:
        yield "mode 0555"
    finally:
        os.chmod(d, mode)


# -- faults ---------------------------------------------------------------------------------------------------
def corrupt_entry(topo: Topology, rng: random.Random, rounds: int = 3, every_s: float = 8.0) -> dict:
    i = rng.randrange(len(topo.servers))
    mem = Path(topo.servers[i].settings.cache.mem_dir)
    before = store_events(topo, i).get("corrupt", 0)
    hit = []
    for k in range(rounds):
        entries = []
        for p in mem.glob("*.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                entries.append((p.stat().st_atime_ns, p))
        for _, p in sorted(entries, reverse=True)[:2]:  # the two most recently used: what the load reads now
            with contextlib.suppress(FileNotFoundError):
                corrupt_file(p, rng=rng)
                hit.append(p.stem[:12])
        if k + 1 < rounds:
            time.sleep(every_s)
    return {"target": f"server{i}", "restored": time.perf_counter(), "corrupted": hit, "server": i,
            "corrupt_before": before}


def corrupt_then_evict(topo: Topology, rng: random.Random, rounds: int = 3, every_s: float = 8.0) -> dict:
    """``corrupt_entry``'s damage to the two least recently used memory entries: the next the churn moves to disk."""
    i = rng.randrange(len(topo.servers))
    cache = topo.servers[i].settings.cache
    before = store_events(topo, i).get("corrupt", 0)
    victims = []
    for k in range(rounds):
        entries = []
        for p in Path(cache.mem_dir).glob("*.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                entries.append((p.stat().st_atime_ns, p))
        for _, p in sorted(entries)[:2]:
            with contextlib.suppress(FileNotFoundError):
                corrupt_file(p, rng=rng)
                victims.append(p.stem)
        if k + 1 < rounds:
            time.sleep(every_s)
    return {"target": f"server{i}", "restored": time.perf_counter(), "server": i, "corrupt_before": before,
            "victims": victims}


def carried_to_disk(topo: Topology, i: int, keys: list[str]) -> int:
    """Entries of ``keys`` in backend ``i``'s disk tier that do not verify (a rewrite since verifies: not counted)."""
    from maskedit.cache.store import CorruptEntry, open_file

    bad = 0
    for key in set(keys):
        p = Path(topo.servers[i].settings.cache.disk_dir) / f"{key}.safetensors"
        try:
            open_file(p, verify=True)
        except FileNotFoundError:
            continue
        except (CorruptEntry, ValueError, OSError):
            bad += 1
    return bad


def found_at_eviction(topo: Topology, i: int, keys: list[str], since_wall: float) -> int:
    """``corrupt activation entry discarded`` lines of backend ``i`` for ``keys`` found at eviction since then."""
    n = 0
    for line in topo.servers[i].log_path.read_text(errors="replace").splitlines():
        if "corrupt activation entry discarded" not in line or "found at eviction" not in line:
            continue
        with contextlib.suppress(ValueError, KeyError):
            entry = json.loads(line)
            ts = calendar.timegm(time.strptime(entry["ts"][:19], "%Y-%m-%dT%H:%M:%S"))
            n += entry.get("key") in keys and ts >= since_wall - 1
    return n


def disk_unwritable(topo: Topology, rng: random.Random, hold_s: float = 30.0) -> dict:
    i = rng.randrange(len(topo.servers))
    cache = topo.servers[i].settings.cache
    peaks: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_mem_sampler, args=(cache, stop, peaks), daemon=True)
    sampler.start()
    with read_only(Path(cache.disk_dir)) as how:
        time.sleep(hold_s)
        degraded = store_events(topo, i).get("degraded_disk")
    restored = time.perf_counter()
    cleared = None
    while time.perf_counter() - restored < 30.0:  # the tier shows healthy again by itself (the store's probe)
        if not store_events(topo, i).get("degraded_disk"):
            cleared = round(time.perf_counter() - restored, 2)
            break
        time.sleep(0.25)
    stop.set()
    sampler.join()
    return {"target": f"server{i}", "restored": restored, "how": how, "server": i,
            "mem_budget_bytes": cache.mem_bytes, **peaks, "degraded_shown": bool(degraded),
            "degraded_cleared_after_s": cleared, "over_budget": peaks.get("mem_peak_bytes", 0) > cache.mem_bytes}


def mem_fs_full(topo: Topology, rng: random.Random, hold_s: float = 30.0, fs_mb: int = 3) -> dict:
    if os.geteuid() != 0:
        raise RuntimeError("mounting a small filesystem over the memory tier needs root")
    i = rng.randrange(len(topo.servers))
    mem = Path(topo.servers[i].settings.cache.mem_dir)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={fs_mb}m", "tmpfs", str(mem)], check=True,
                   capture_output=True)
    t_in = time.perf_counter()
    first = store_events(topo, i)
    try:
        time.sleep(hold_s)
        events = store_events(topo, i)
    finally:
        for _ in range(50):
            if subprocess.run(["umount", "-l", str(mem)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
    return {"target": f"server{i}", "restored": time.perf_counter(), "server": i, "fs_mb": fs_mb,
            "window": [t_in, time.perf_counter()],
            **{f"{k}_during": events.get(k, 0) - first.get(k, 0) for k in ("inserts", "refused", "errors", "evictions")}}


FAULTS = {f.__name__: f for f in (corrupt_entry, corrupt_then_evict, disk_unwritable, mem_fs_full)} | \
    {"sigstop_router": chaos.sigstop_router, "kill_denoise_stub": chaos.kill_denoise_stub}
FROM_INJECTION = ("kill_denoise_stub",)  # recovery runs from the fault itself: it has no end the system waits for


# -- judging --------------------------------------------------------------------------------------------------
def psnr(a: bytes, b: bytes) -> float:
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(v)).convert("RGB"), np.float64) for v in (a, b))
    mse = float(np.mean((x - y) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def served_corrupt(topo: Topology, records, images: dict, reqs, t_inject: float, limit: int = 24,
                   min_psnr: float = 25.0) -> tuple[int, int]:
    """Hits answered after the first injection whose image is far from the same request computed with the cache
    off (a hit is within a few dB of it; an image built from corrupt bytes is not). Returns (checked, corrupt)."""
    from maskedit_client import EditClient

    assets = runner.Assets(256)
    cands = [r for r in records if r.error is None and r.cache_hit and r.submit_s >= t_inject and r.index in images]
    picked = cands[::max(1, len(cands) // limit)][:limit]
    bad = 0
    with EditClient(topo.url) as client:
        for r in picked:
            q = reqs[r.index]
            ref = client.edit(assets.template(q.template), assets.mask(q), q.prompt, seed=q.seed, steps=q.steps,
                              use_cache=False)
            bad += int(psnr(images[r.index], ref.png) < min_psnr)
    return len(picked), bad


def row(fault: str, case: dict, corrupt_served: int = 0, **extra) -> dict:
    return {"fault": fault, "sent": case["sent"], "ok": case["ok"],
            "errors": sum(case["failed_by_code"].values()), "lost": case["lost"], "corrupt_served": corrupt_served,
            "recovery_s": case.get("recovery_s"), "errors_by_code": case["failed_by_code"],
            "p95_before_s": case["p95_before_s"], "p95_during_s": case["p95_during_s"],
            "p95_after_s": case["p95_after_s"], "detail": case["fault_detail"], **extra}


def recovery(case: dict, recs, fault: str) -> dict:
    """``recovery_s`` and the hit rates around the fault: from the fault's end (``FROM_INJECTION``: the fault
    itself) until the later of full strength reached (``full_strength.weak_spots`` empty, polled during the case) and
    the hit rate back (10 requests in a row within 10 % of the rate before the fault)."""
    d = case["fault_detail"]
    start = case["injected_at_s"] if fault in FROM_INJECTION or not d.get("restored") else d["restored"]
    before = full_strength.hit_rate(recs, 0.0, case["injected_at_s"])
    strong = case.get("recovered_at_s")
    back = None if before is None else full_strength.hit_rate_back_at(recs, start, 0.9 * before)
    ends = [strong, back]
    recovery_s = None if None in ends else round(max(0.0, max(ends) - start), 2)
    after = None if recovery_s is None else full_strength.hit_rate(recs, start + recovery_s)
    return {"recovery_s": recovery_s, "full_strength_after_s": None if strong is None else round(strong - start, 2),
            "hit_rate_back_after_s": None if back is None else round(back - start, 2),
            "hit_rate_before": before, "hit_rate_after": after}


def run_fault(topo: Topology, fault: str, rate: float, duration_s: float, seed: int, hold_s: float,
              templates: int) -> dict:
    sink: dict = {}
    fns = {**FAULTS, "disk_unwritable": lambda t, r: disk_unwritable(t, r, hold_s),
           "mem_fs_full": lambda t, r: mem_fs_full(t, r, hold_s)}
    started_wall = time.time()
    case = chaos.run_case(topo, fault, rate, duration_s, seed=seed, faults=fns, sink=sink, templates=templates,
                          recovered=lambda: not full_strength.weak_spots(topo))
    d, recs = case["fault_detail"], sink["records"]
    case.update(recovery(case, recs, fault))
    injected = "error" not in d
    met = {"fault_injected": injected, "zero_lost": case["lost"] == 0, "no_errors": not case["failed_by_code"],
           "recovered_within_30s": case["recovery_s"] is not None and case["recovery_s"] < 30,
           "hit_rate_back": case["hit_rate_after"] is not None and case["hit_rate_before"] is not None and
           case["hit_rate_after"] >= 0.9 * case["hit_rate_before"]}
    rates = {k: case[k] for k in ("hit_rate_before", "hit_rate_after", "full_strength_after_s",
                                  "hit_rate_back_after_s")}
    if fault in ("corrupt_entry", "corrupt_then_evict"):
        checked, bad = served_corrupt(topo, recs, sink["images"], sink["requests"], case["injected_at_s"])
        i = d.get("server", 0)
        detected = store_events(topo, i).get("corrupt", 0) - d.get("corrupt_before", 0)
        restarted = sum(bool(r.extra.get("cache_corrupt")) for r in recs)
        extra = {}
        if fault == "corrupt_then_evict":
            victims = d.get("victims", [])
            extra = {"victims": len(set(victims)), "found_at_eviction": found_at_eviction(topo, i, victims,
                                                                                          started_wall),
                     "carried_to_disk": carried_to_disk(topo, i, victims)}
            met["none_carried_to_disk"] = extra["carried_to_disk"] == 0
        return row(fault, case, bad, hits_checked=checked, detected_by_service=detected,
                   requests_recomputed=restarted, **extra, **rates,
                   met={**met, "no_corrupt_served": bad == 0, "detected": detected > 0})
    if fault == "disk_unwritable":
        return row(fault, case, **rates, met={**met, "mem_within_budget": not d.get("over_budget", True),
                                              "degraded_shown": bool(d.get("degraded_shown")),
                                              "degraded_cleared": d.get("degraded_cleared_after_s") is not None})
    if fault == "mem_fs_full":
        lo, hi = (t - sink["t0"] for t in (d.get("window") or [0, 0]))
        during = full_strength.hit_rate(recs, lo, hi)
        return row(fault, case, hit_rate_during=during, **rates,
                   met={**met, "entries_kept_coming": d.get("inserts_during", 0) > 0,
                        "hits_kept": during is not None and case["hit_rate_before"] is not None and
                        during >= 0.5 * case["hit_rate_before"]})
    if fault == "sigstop_router":
        return row(fault, case, **rates, met=met)
    if fault == "kill_denoise_stub":
        return row(fault, case, how=d.get("how"), **rates, met=met)
    raise ValueError(fault)


def warm(topo: Topology, templates: int, seed: int = 0) -> None:
    """One request per template through the router, one at a time: every template cached before the faults, so
    each case's hit rate before is the system's, not its first misses'."""
    from maskedit_client import EditClient

    from loadgen import workload

    assets = runner.Assets(256)
    r = workload.poisson(1.0, 1, n_templates=templates, seed=seed)[0]
    with EditClient(topo.url) as client:
        for t in range(templates):
            client.edit(assets.template(t), assets.mask(r), r.prompt, seed=r.seed, steps=r.steps)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(rows))
    for k, (key, color) in enumerate((("ok", "tab:green"), ("errors", "tab:orange"), ("lost", "black"),
                                      ("corrupt_served", "tab:red"))):
        v = [r[key] for r in rows]
        ax.bar(x + (k - 1.5) * 0.2, v, 0.2, label=key, color=color)
        for xi, vi in zip(x, v):
            ax.text(xi + (k - 1.5) * 0.2, vi, str(vi), ha="center", va="bottom", fontsize=7)
    ax.set(xticks=x, ylabel="requests", title="faults under load through the router (2 instances, CPU)")
    ax.set_xticklabels([r["fault"] for r in rows], fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    names = list(FAULTS) + ["idle_streams"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", default=",".join(names), help=f"comma-separated, from {', '.join(names)}")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=100.0, help="seconds of load per fault (the fault in its "
                    "first half, then time to recover and to measure the hit rate after)")
    ap.add_argument("--hold", type=float, default=20.0, help="seconds a storage fault lasts")
    ap.add_argument("--note", default="", help="about the host during the run (recorded with the load average)")
    ap.add_argument("--mem-mb", type=int, default=4, help="each instance's memory-tier budget (small: evictions)")
    ap.add_argument("--templates", type=int, default=12, help="templates the load cycles through (churn)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "faults")
    ap.add_argument("--result", type=Path, default=RESULTS / "faults.json")
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if [f for f in faults if f not in names]:
        ap.error(f"--faults: choose from {names}")
    env = {"MASKEDIT_CACHE_MEM_BYTES": str(args.mem_mb << 20)}
    rows, t_start, load = [], time.time(), [os.getloadavg()]
    # The router's OpenAI port off: its default (7003) may be taken on a shared host.
    with running_topology(args.instances, args.out, env, router_args=["--openai-port", "0"]) as topo:
        warm(topo, args.templates, args.seed)
        for k, fault in enumerate(faults):
            print(f"[{k + 1}/{len(faults)}] {fault} at {args.rate} req/s for {args.duration:g} s", flush=True)
            if fault == "idle_streams":
                r = fault_streams.idle_streams(topo, rate=args.rate, duration_s=args.duration, seed=args.seed + k)
            else:
                r = run_fault(topo, fault, args.rate, args.duration, args.seed + k, args.hold, args.templates)
            r["load_average"] = [round(x, 2) for x in os.getloadavg()]
            load.append(os.getloadavg())
            rows.append(r)
            print(json.dumps({k2: v for k2, v in r.items() if k2 not in ("detail",)}, default=str), flush=True)
            chaos._settle(topo)
        leftovers = topo.leftovers()
    result = {"command": "python -m maskedit_lab.reliability.faults "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
              "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "device": "cpu", "dtype": "float32",
                       "note": args.note, "load_average_1m": {"min": round(min(x[0] for x in load), 2),
                                                              "max": round(max(x[0] for x in load), 2)}},
              "instances": args.instances, "rate": args.rate, "duration_s": args.duration, "hold_s": args.hold,
              "mem_mb": args.mem_mb, "rows": rows, "leftovers_after_shutdown": leftovers,
              "all_met": all(all(r.get("met", {}).values()) for r in rows) and not any(leftovers.values())}
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1, default=str))
    plot(rows, args.result.with_suffix(".png"))
    print(f"wrote {args.result} and {args.result.with_suffix('.png')}; all targets met: {result['all_met']}")


if __name__ == "__main__":
    main()
