"""`python -m maskedit_lab.reliability.report`: the Markdown tables of docs/reliability.md from the committed chaos,
faults, overload and soak results (perf_profiles/results/{chaos,faults,overload,overload_flood*,soak}.json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from maskedit.settings import REPO_ROOT

RESULTS = REPO_ROOT / "perf_profiles" / "results"


def _f(v, nd=2):
    return "–" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _codes(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "0"


def chaos(r: dict) -> str:
    rows = ["| fault | sent | ok | failed by code | lost | P95 before / during / after (s) | time to recover (s) | "
            "in rotation after restart (s) | left behind |", "|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        left = sum(len(v) for v in c["leftovers"].values())
        rows.append(f"| {c['fault']} | {c['sent']} | {c['ok']} | {_codes(c['failed_by_code'])} | {c['lost']} | "
                    f"{_f(c['p95_before_s'])} / {_f(c['p95_during_s'])} / {_f(c['p95_after_s'])} | "
                    f"{_f(c['time_to_recover_s'], 1)} | {_f(c['recovered_after_restart_s'], 1)} | {left} |")
    left = sum(len(v) for v in r["leftovers_after_shutdown"].values())
    return "\n".join(rows) + (f"\n\n{r['instances']} instances, {r['rate']} req/s open loop through the router, "
                              f"{r['duration_s']:g} s per fault; after shutdown {left} processes/regions/ports left; "
                              f"all targets met: {r['all_met']}. `{r['command']}`, started {r['started']}.")


def faults(r: dict) -> str:
    """``make faults``: per fault, how every request ended, what was served, and recovery to full strength."""
    rows = ["| fault | sent | ok | errors | lost | corrupt served | recovery s (full strength / hits back) | "
            "hit rate before / after | load average | targets met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        rec = f"{_f(x.get('recovery_s'), 1)} ({_f(x.get('full_strength_after_s'), 1)} / " \
              f"{_f(x.get('hit_rate_back_after_s'), 1)})" if "full_strength_after_s" in x else _f(x.get("recovery_s"), 2)
        rates = f"{_f(x.get('hit_rate_before'))} / {_f(x.get('hit_rate_after'))}" if "hit_rate_before" in x else "–"
        missed = [k for k, v in x.get("met", {}).items() if not v]
        rows.append(f"| `{x['fault']}` | {x['sent']} | {x['ok']} | {x['errors']} | {x['lost']} | "
                    f"{x['corrupt_served']} | {rec} | {rates} | {_f((x.get('load_average') or [None])[0], 1)} | "
                    f"{'all' if not missed else 'not ' + ', '.join(missed)} |")
    left = sum(len(v) for v in r["leftovers_after_shutdown"].values())
    load = r["host"].get("load_average_1m") or {}
    return "\n".join(rows) + (f"\n\n{r['instances']} instances, {r['rate']} req/s open loop through the router, "
                              f"{r['duration_s']:g} s per fault (storage faults held {r['hold_s']:g} s), memory tier "
                              f"{r['mem_mb']} MB; load average {load.get('min')}-{load.get('max')} "
                              f"({r['host'].get('note') or 'no note'}); after shutdown {left} processes/regions/ports "
                              f"left; all targets met: {r['all_met']}. `{r['command']}`, started {r['started']}.")


def overload(r: dict) -> str:
    rows = ["| target | capacity (req/s) | offered (req/s) | sent | ok | served (req/s) | refused (RESOURCE_EXHAUSTED) | "
            "refused by: n (slowest s) | other errors | lost | refusal max / P99 (s) | refused within 1 s | "
            "P95 served (s) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in r["targets"].items():
        by = ", ".join(f"{k} {v['n']} ({v['max_s']:.2f})" for k, v in t.get("refused_by", {}).items()) or "–"
        rows.append(f"| {name} | {t['capacity']} | {t['rate']} | {t['sent']} | {t['ok']} | {_f(t.get('throughput'))} | "
                    f"{t['refused']} | {by} | {_codes(t['other_errors'])} | {t['lost']} | {_f(t['refusal_max_s'], 3)} / "
                    f"{_f(t['refusal_p99_s'], 3)} | {_f(t['refused_within_1s'] and 100 * t['refused_within_1s'], 1)} % | "
                    f"{_f(t['ok_p95_s'])} |")
    text = "\n".join(rows) + (f"\n\n{r['steps']} denoising steps, denoise queue {r['max_queue']}; all targets met: "
                              f"{r['all_met']}. `{r['command']}`, started {r['started']}.") if r["targets"] else ""
    if r.get("flood"):
        text += ("\n\n" if text else "") + flood(r)
    if r.get("router_ab"):
        ab = ["| pair | router admission | sent | ok | served (req/s) | refused | refused by: n (slowest s) | lost | "
              "refusal max (s) | refused within 1 s | P95 served (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in r["router_ab"]:
            by = ", ".join(f"{k} {v['n']} ({v['max_s']:.2f})" for k, v in x["refused_by"].items()) or "–"
            ab.append(f"| {x['pair']} | {x['admission']} | {x['sent']} | {x['ok']} | {_f(x['served'])} | {x['refused']} | "
                      f"{by} | {x['lost']} | {_f(x['refusal_max_s'], 3)} | "
                      f"{_f(x['refused_within_1s'] and 100 * x['refused_within_1s'], 1)} % | {_f(x['ok_p95_s'])} |")
        means = {m: [x["served"] for x in r["router_ab"] if x["admission"] == m] for m in ("on", "off")}
        text += ("\n\nThrough the router at the same rate, its own admission on and off (interleaved pairs, same "
                 "arrivals within a pair):\n\n" + "\n".join(ab) + "\n\nServed per second, mean: " +
                 " / ".join(f"{m} {sum(v) / len(v):.2f}" for m, v in means.items() if v) + ".")
    return text


def flood(r: dict) -> str:
    f = r["flood"]
    by = ", ".join(f"{k} {v['n']} ({v['max_s']:.2f})" for k, v in f.get("refused_by", {}).items()) or "–"
    la = f["load_average"]
    deadline = (f", DEADLINE_MS {f['deadline_ms']} ({f['deadline_exceeded']} answered DEADLINE_EXCEEDED)"
                if f.get("deadline_ms") else "")
    ended = f"{f.get('ended_at_bound', 0)} ({_f(f.get('ended_max_s'), 2)})" if f.get("ended_at_bound") else "0"
    bound = f", server bound (MASKEDIT_LATENCY_BOUND_S) {r['latency_bound_s']:g} s" if r.get("latency_bound_s") else ""
    return ("| flood | sent | ok | refused | refused by: n (slowest s) | ended at its bound: n (slowest s) | "
            "other errors | late | lost | answered max (s) | refusal max / P99 (s) | served max / P95 (s) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            f"| {f['sent']} in {f['spread_s']:g} s at one server | {f['sent']} | {f['ok']} | {f['refused']} | {by} | "
            f"{ended} | {_codes(f['other_errors'])} | {f['late']} | {f['lost']} | {_f(f['answered_max_s'], 3)} | "
            f"{_f(f['refusal_max_s'], 3)} / {_f(f['refusal_p99_s'], 3)} | {_f(f['ok_max_s'], 3)} / {_f(f['ok_p95_s'])} |"
            f"\n\n{f['steps']} denoising steps{deadline}{bound}, denoise queue {r['max_queue']}, late: answered after "
            f"{f['within_s']:g} s; load average before {la['before']}, after {la['after']} (1, 5, 15 min); met: "
            f"{f['met']}. `{r['command']}`, started {r['started']}.")


def soak(r: dict) -> str:
    s = r["summary"]
    rows = ["| window | sent | ok | errors | P50 (s) | P95 (s) | hit rate |", "|---|---|---|---|---|---|---|"]
    for w in r["windows"]:
        rows.append(f"| {w['window']} | {w['sent']} | {w['ok']} | {_codes(w['errors'])} | {_f(w['p50_s'])} | "
                    f"{_f(w['p95_s'])} | {_f(w['hit_rate'])} |")
    slopes = ", ".join(f"{k} {_f(v)}" for k, v in r["memory_slope_mb_per_10min"].items())
    first, last = r["samples"][0], r["samples"][-1]
    rss = ", ".join(f"{k} {first['rss'].get(k, 0) / 2**20:.0f}→{v / 2**20:.0f}" for k, v in sorted(last["rss"].items()))
    mapped = ""
    if "store_mapped" in r:  # runs before the split judged RSS as a whole
        m = r["store_mapped"]
        mapped = (f"RSS slopes, mapped store entries included: "
                  f"{', '.join(f'{k} {_f(v)}' for k, v in r['rss_slope_mb_per_10min'].items())}. Mapped store pages at "
                  f"their peak (MiB): {', '.join(f'{k} {v:g}' for k, v in m['peak_mb'].items())}; a process may hold "
                  f"{m['bound_entries']} entries of {m['largest_entry_mb']:g} MiB = {m['bound_mb']:g} MiB. ")
    return "\n".join(rows) + (
        f"\n\n{r['minutes']:g} min at {r['rate']:g} req/s (the knee of the sweep) through the router, {r['instances']} "
        f"instances, {r['templates']} templates (Zipf {r['zipf']}), store memory budget {r['mem_budget_mb']} MB per "
        f"instance: {s['requests']} sent, {s['completed']} ok, errors {_codes(s['errors'])}, {s['lost']} lost. "
        f"Memory slope after the first window (MB per 10 min"
        f"{', outside mapped store entries' if mapped else ''}): {slopes}. {mapped}RSS first→last sample (MiB): {rss}. "
        f"/dev/shm {sum(first['shm'].values()) / 2**20:.0f}→{sum(last['shm'].values()) / 2**20:.0f} MiB, disk tier "
        f"{sum(first['disk'].values()) / 2**20:.0f}→{sum(last['disk'].values()) / 2**20:.0f} MiB. Targets met: "
        f"{r['met']}. Host: {r['host']['note']}. `{r['command']}` at revision {r.get('revision')}, started "
        f"{r['started']}.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    floods = sorted(p.stem for p in args.results.glob("overload_flood*.json"))
    for name, fn in (("chaos", chaos), ("faults", faults), ("overload", overload), *((f, overload) for f in floods),
                     ("soak", soak)):
        p = args.results / f"{name}.json"
        if p.exists():
            print(f"### {name} ({p.relative_to(REPO_ROOT) if p.is_relative_to(REPO_ROOT) else p})\n")
            print(fn(json.loads(p.read_text())) + "\n")


if __name__ == "__main__":
    main()
