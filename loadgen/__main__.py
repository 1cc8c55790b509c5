"""`python -m loadgen`: drive a maskedit endpoint (Triton or the router) and write records and plots.

    python -m loadgen --url 127.0.0.1:8001 --rate 2 --requests 60 --workload public
    python -m loadgen --url 127.0.0.1:8001 --gentd26 --time-scale 60 --requests 100
    python -m loadgen --url 127.0.0.1:8001 --trace my_trace.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from . import records, runner, workload


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="127.0.0.1:8001")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    src.add_argument("--trace", type=Path, help="our trace format (.jsonl or .csv)")
    src.add_argument("--gentd26", type=Path, nargs="?", const=workload.GENTD26,
                     help="replay the arrival process of the GenTD26 request log (default: the one shipped in "
                          "loadgen/traces)")
    ap.add_argument("--time-scale", type=float, default=60.0, help="GenTD26: compress time by this factor")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--workload", choices=sorted(workload.WORKLOADS), default="public")
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--lora-dir", type=Path, help="GenTD26: replay each request's num_lora with adapters drawn "
                    "(seeded, Zipf --lora-zipf in name order) from this adapter library's names, sent as LORAS")
    ap.add_argument("--loras", help="GenTD26: the same from these comma-separated adapter names (most popular first)")
    ap.add_argument("--lora-zipf", type=float, default=1.1)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--deadline-ms", type=int)
    ap.add_argument("--size", type=int, default=256, help="template side in pixels")
    ap.add_argument("--register", action="store_true", help="warm the activation cache for every template first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0,
                    help="after the last send, wait this long; requests still unanswered are recorded as LOST")
    ap.add_argument("--out", type=Path, default=Path("out/loadgen"))
    ap.add_argument("--name", default="run")
    args = ap.parse_args(argv)
    from maskedit_client import EditClient

    kw = dict(workload=args.workload, n_templates=args.templates, zipf_s=args.zipf, steps=args.steps,
              deadline_ms=args.deadline_ms, seed=args.seed)
    if args.trace:
        reqs = workload.load_trace(args.trace)[: args.requests]
        rate = None
    elif args.gentd26:
        arrivals, _ = workload.gentd26_arrivals(args.gentd26, args.time_scale, limit=args.requests, seed=args.seed)
        reqs = workload.synthesize(arrivals, **kw)
        rate = len(arrivals) / max(arrivals[-1], 1e-9)
        library = args.loras.split(",") if args.loras else None
        if args.lora_dir:
            from maskedit_common.loras import library_names

            library = library_names(args.lora_dir)
        if library:
            workload.assign_loras(reqs, workload.gentd26_num_lora(args.gentd26, limit=args.requests), library,
                                  args.lora_zipf, args.seed)
    else:
        reqs = workload.poisson(args.rate, args.requests, **kw)
        rate = args.rate
    with EditClient(args.url) as client:
        recs, wall = runner.run(client, reqs, runner.Assets(args.size), timeout_s=args.timeout_s,
                                register_templates=args.register)
    summary = dict(records.summarize(recs, wall), rate=rate, mode=args.name)
    records.write(recs, summary, args.out, args.name)
    records.plot_runs({args.name: (recs, summary)}, args.out / f"{args.name}.png", title=args.name)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})
    print(f"wrote {args.out}/{args.name}.json, .csv and .png")
    np.seterr(all="ignore")


if __name__ == "__main__":
    main()
