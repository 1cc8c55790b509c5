"""`make serve-cluster`: N local Triton instances plus the router in front of them, until Ctrl-C.

Each instance gets its own ports and activation-store directories, as separate machines would (memory tier in
/dev/shm, removed on exit; disk tier under ``--out``). A supervisor restarts an instance that dies (see
``supervisor``); the router takes it back once a real request succeeds on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from maskedit.launcher import TritonServer
from maskedit_router.__main__ import build, serve
from maskedit_router.admission import AdmissionWatcher
from maskedit_router.health import HealthChecker
from maskedit_router.policies import POLICIES
from maskedit_router.openai_api import OpenAIServer

from . import REPO_ROOT
from .supervisor import RELOADABLE_ARGS, Supervisor


@contextlib.contextmanager
def running_backends(instances: int, out: Path, env: dict | None = None, supervise: bool = True):
    """Start ``instances`` Triton servers (own ports and store directories each), watched by a ``Supervisor``
    that reloads a model whose stub died and reaps and restarts a server that dies; yield ``(servers, supervisor or None)``; stop everything, by pid, on
    the way out."""
    servers = []
    # Instances on one host share its cores: each denoise loop gets its share. With every instance using all
    # cores, OpenMP thread teams oversubscribe them and a step can take seconds instead of milliseconds.
    share = {"MASKEDIT_THREADS_MASKED_DENOISE": str(max(1, (os.cpu_count() or 1) // instances))}
    # The activation store's memory tier in RAM, as in production (a disk-backed directory would add page
    # writeback to every entry written); removed on the way out.
    ram = Path(tempfile.mkdtemp(prefix="maskedit-cluster-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    supervisor = None
    try:
        for i in range(instances):
            d = Path(out) / f"instance{i}"
            servers.append(TritonServer(log_path=d / "tritonserver.log", env={
                **share, **(env or {}),
                "MASKEDIT_CACHE_MEM_DIR": str(ram / f"instance{i}"), "MASKEDIT_CACHE_DISK_DIR": str(d / "cache"),
            }, extra_args=list(RELOADABLE_ARGS) if supervise else None).start())  # a dead model: reloaded alone
        supervisor = Supervisor(servers).start() if supervise else None
        yield servers, supervisor
    finally:
        if supervisor is not None:
            supervisor.stop()
        for s in servers:
            s.stop()
        shutil.rmtree(ram, ignore_errors=True)


@contextlib.contextmanager
def running_cluster(instances: int, out: Path, port: int = 0, http_port: int | None = None,
                    policy: str = "predicted", env: dict | None = None, health: HealthChecker | dict | None = None,
                    supervise: bool = True, openai_port: int | None = None):
    """Start ``instances`` Triton servers (see ``running_backends``) and the router in front of them (with the
    OpenAI API on ``openai_port`` if given); yield ``(router, router_grpc_url, servers)``; stop everything, by pid,
    on the way out."""
    with running_backends(instances, out, env, supervise) as (servers, _):
        router = build([s.grpc_url for s in servers], policy)
        grpc_server, bound, httpd = serve(router, port, http_port)
        checker = HealthChecker(router, **(health or {})).start()
        watcher = AdmissionWatcher(router).start()
        openai = OpenAIServer(f"127.0.0.1:{bound}", openai_port).start() if openai_port else None
        try:
            yield router, f"127.0.0.1:{bound}", servers
        finally:
            if openai:
                openai.stop()
            checker.stop()
            watcher.stop()
            grpc_server.stop(grace=1).wait(10)
            if httpd:
                httpd.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--port", type=int, default=7001)
    ap.add_argument("--http-port", type=int, default=7002)
    ap.add_argument("--openai-port", type=int, default=7003, help="OpenAI-compatible HTTP API (0: off)")
    ap.add_argument("--policy", default="predicted", choices=list(POLICIES))
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "cluster")
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with running_cluster(args.instances, args.out, args.port, args.http_port, args.policy,
                         openai_port=args.openai_port or None) as (router, url, servers):
        print(json.dumps({"router_grpc": url, "router_http": args.http_port, "openai": args.openai_port or None,
                          "backends": [s.grpc_url for s in servers]}), flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
