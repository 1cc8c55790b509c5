"""`make serve-cluster`: N local Triton instances plus the router in front of them, until Ctrl-C.

Each instance gets its own ports and activation-store directories, as separate machines would (memory tier in
/dev/shm, removed on exit; disk tier under ``--out``). A supervisor restarts an instance that dies (see
``supervisor``); the router takes it back once a real request succeeds on it.

The router is started by ``maskedit_router.__main__.start``, as ``python -m maskedit_router`` starts it: the
settings' API keys (``MASKEDIT_API_KEYS_FILE``), TLS and backend key apply here too. With API keys on, the
backends are guarded (``backend_env``): a backend key is made unless one is configured, and only the router,
which sends it, may call them.
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

from maskedit.launcher import TritonServer, free_port
from maskedit.scratch import run_scratch
from maskedit_common import backend_guard
from maskedit_common.settings import load_settings
from maskedit_router.__main__ import parser as router_parser, start as start_router
from maskedit_router.placement.policies import POLICIES

from .. import REPO_ROOT
from .supervisor import RELOADABLE_ARGS, Supervisor


def backend_env(out: Path, env: dict | None = None, keys: bool = False) -> dict:
    """What the launchers add to the backends' environment: the backend key (``MASKEDIT_BACKEND_KEY_FILE``) when
    one is configured, else, whenever API keys are on (``keys``, or ``MASKEDIT_API_KEYS_FILE`` here or in ``env``),
    a new random one in ``out/backend.key`` (owner-only): keys on means the backends take calls from the router
    only. Nothing with keys off."""
    sec = load_settings({**os.environ, **(env or {})}).security
    name = "MASKEDIT_BACKEND_KEY_FILE"
    if sec.backend_key_file:
        return {name: str(sec.backend_key_file)}
    if keys or sec.api_keys_file:
        return {name: str(backend_guard.create(Path(out) / "backend.key"))}
    return {}


def router_security_args(env: dict | None = None) -> list[str]:
    """The router's key, TLS and backend-key arguments from the settings of this environment with ``env`` over it
    (the backends' environment: the router is configured as they are)."""
    sec = load_settings({**os.environ, **(env or {})}).security
    out = []
    for flag, value in (("--api-keys-file", sec.api_keys_file), ("--tls-cert", sec.tls_cert),
                        ("--tls-key", sec.tls_key), ("--backend-key-file", sec.backend_key_file)):
        if value:
            out += [flag, str(value)]
    return out


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
    # Cancel markers and queue boards too (shared by the instances, as on one host in production; each board is
    # named by its server): the settings' defaults would leave /dev/shm/maskedit-$UID behind. A setting given wins.
    given = {**os.environ, **(env or {})}
    shared = {k: str(ram / sub) for k, sub in (("MASKEDIT_CANCEL_DIR", "cancel"),
                                               ("MASKEDIT_ADMISSION_DIR", "admission")) if k not in given}
    supervisor = None
    try:
        for i in range(instances):
            d = Path(out) / f"instance{i}"
            servers.append(TritonServer(log_path=d / "tritonserver.log", env={
                **share, **shared, **(env or {}),
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
def running_router(addrs: list[str], port: int = 0, http_port: int | None = None, policy: str = "predicted",
                   health: dict | None = None, openai_port: int | None = None, env: dict | None = None,
                   router_args: list | tuple = ()):
    """The router in front of the Triton instances at ``addrs`` (gRPC ``addrs``), on ``port`` (0: a free one), with
    its HTTP port and the OpenAI API on ``openai_port`` if given, started by ``maskedit_router.__main__.start`` with
    the settings of this environment and ``env`` (keys, TLS, the backend key); ``router_args``: more of its
    arguments; ``health``: its health checker's intervals. Yields ``(router, router_grpc_url)``."""
    argv = ["--backends", ",".join(addrs), "--port", str(port),
            "--http-port", str(http_port if http_port is not None else free_port()),
            "--openai-port", str(openai_port or 0), "--policy", policy, *router_security_args(env), *router_args]
    running = start_router(router_parser().parse_args(argv), health)
    try:
        yield running.router, running.url
    finally:
        running.stop()


@contextlib.contextmanager
def running_cluster(instances: int, out: Path, port: int = 0, http_port: int | None = None,
                    policy: str = "predicted", env: dict | None = None, health: dict | None = None,
                    supervise: bool = True, openai_port: int | None = None, router_args: list | tuple = ()):
    """Start ``instances`` Triton servers (see ``running_backends``; guarded when API keys are on: ``backend_env``)
    and the router in front of them (``running_router``); yield ``(router, router_grpc_url, servers)``; stop
    everything, by pid, on the way out."""
    env = {**(env or {}), **backend_env(out, env)}
    with running_backends(instances, out, env, supervise) as (servers, _), \
            running_router([s.grpc_url for s in servers], port, http_port, policy, health, openai_port, env,
                           router_args) as (router, url):
        yield router, url, servers


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
    try:
        with run_scratch(), running_cluster(args.instances, args.out, args.port, args.http_port, args.policy,
                                           openai_port=args.openai_port or None) as (router, url, servers):
            print(json.dumps({"router_grpc": url, "router_http": args.http_port, "openai": args.openai_port or None,
                              "api_keys": "--api-keys-file" in router_security_args(),
                              "backend_key": bool(router.backend_key), "backends": [s.grpc_url for s in servers],
                              "backends_http": [s.http_url for s in servers]}), flush=True)
            stop.wait()
    except ValueError as e:  # a bad key file, TLS file or backend key: named, never the key
        ap.error(str(e))
    print("cluster stopped", flush=True)


if __name__ == "__main__":
    main()
