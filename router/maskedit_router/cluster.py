"""`make serve-cluster`: N local Triton instances plus the router in front of them, until Ctrl-C.

Each instance gets its own ports and activation-store directories (as separate machines would).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path

from maskedit.launcher import TritonServer
from maskedit.settings import REPO_ROOT

from .__main__ import build, serve
from .health import HealthChecker


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--port", type=int, default=7001)
    ap.add_argument("--http-port", type=int, default=7002)
    ap.add_argument("--policy", default="predicted")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "cluster")
    args = ap.parse_args(argv)
    servers = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        for i in range(args.instances):
            d = args.out / f"instance{i}"
            servers.append(TritonServer(log_path=d / "tritonserver.log", env={
                "MASKEDIT_CACHE_MEM_DIR": f"/dev/shm/maskedit-cluster/{i}", "MASKEDIT_CACHE_DISK_DIR": str(d / "cache")},
            ).start())
        router = build([s.grpc_url for s in servers], args.policy)
        grpc_server, port, httpd = serve(router, args.port, args.http_port)
        health = HealthChecker(router).start()
        print(json.dumps({"router_grpc": f"127.0.0.1:{port}", "router_http": args.http_port,
                          "backends": [s.grpc_url for s in servers]}), flush=True)
        stop.wait()
        health.stop()
        grpc_server.stop(grace=5).wait(10)
        httpd.shutdown()
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
