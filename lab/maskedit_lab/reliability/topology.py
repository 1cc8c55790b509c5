"""The system chaos and soak runs drive: supervised Triton instances (the lab's ``cluster.running_backends``) and
the router as its own process (``python -m maskedit_router``, which starts it as every launcher does), so the router
can be killed and restarted like any other part. With API keys on the backends are guarded as the lab cluster's
(``cluster.backend_env``). Everything is stopped by pid on the way out and checked for leftovers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from maskedit import admission
from maskedit.launcher import free_port
from maskedit_common.settings import load_settings
from maskedit_lab.harness.cluster import backend_env, running_backends
from maskedit_lab.harness.supervisor import Supervisor

from . import footprint


@dataclass
class Topology:
    servers: list
    supervisor: Supervisor
    out: Path
    router_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    router: subprocess.Popen | None = None
    seen: dict = field(default_factory=dict)  # every pgid / shm prefix / port used, for the leak check
    router_starts: int = 0
    router_args: list = field(default_factory=list)  # extra ``python -m maskedit_router`` arguments
    api_key: str | None = None  # the load's key while the router runs with keys on (``keys_on``)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    def remember(self) -> None:
        """Note the current generation of every part (a restart makes a new one) for the final leak check."""
        for s in self.servers:
            if s.proc is not None:
                self.seen.setdefault("pgids", set()).add(s.proc.pid)
                self.seen.setdefault("shm", set()).add(s.shm_prefix)
                self.seen.setdefault("ports", set()).update({s.grpc_port, s.http_port, s.metrics_port})
        if self.router is not None:
            self.seen.setdefault("pgids", set()).add(self.router.pid)
        self.seen.setdefault("ports", set()).update({self.router_port, self.http_port})

    # -- the router process ---------------------------------------------------------------------------
    def start_router(self, timeout_s: float = 60.0) -> None:
        log = open(self.out / "router.log", "ab")
        self.router = subprocess.Popen(
            [sys.executable, "-m", "maskedit_router", "--backends", ",".join(s.grpc_url for s in self.servers),
             "--port", str(self.router_port), "--http-port", str(self.http_port),
             "--openai-port", "0", *self.router_args],  # no OpenAI port unless asked: 7003 may be another's
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.router_starts += 1
        self.remember()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited with {self.router.returncode}; see {self.out / 'router.log'}")
            h = self.health()
            if h and h.get("ready"):
                return
            time.sleep(0.2)
        raise TimeoutError("router not ready")

    @contextlib.contextmanager
    def keys_on(self, tenant: str = "load"):
        """The router restarted with a key file (one user key for ``tenant``, in ``api_key``), and back without
        it on the way out: the same faults and load, every request authenticated."""
        key = "sk-" + os.urandom(16).hex()
        path = self.out / "keys.txt"
        path.write_text(f"{key} {tenant} user\n")
        path.chmod(0o600)
        before = list(self.router_args)
        self.stop_router()
        self.router_args, self.api_key = before + ["--api-keys-file", str(path)], key
        self.start_router()
        try:
            yield key
        finally:
            self.stop_router()
            self.router_args, self.api_key = before, None
            self.start_router()

    def kill_router(self) -> None:
        if self.router is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.router.pid, signal.SIGKILL)
        self.router.wait(10)

    def stop_router(self) -> None:
        if self.router is None or self.router.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.router.pid, signal.SIGTERM)
        try:
            self.router.wait(15)
        except subprocess.TimeoutExpired:
            self.kill_router()

    def health(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def all_in_rotation(self) -> bool:
        h = self.health()
        return bool(h) and all(b.get("in_rotation") for b in h["backends"])

    # -- what is left -----------------------------------------------------------------------------------
    def leftovers(self, settle_s: float = 30.0) -> dict:
        """Processes, /dev/shm regions and listening ports of any generation that should be gone: those of
        parts no longer running (call after a recovery, or after everything stopped). What is still there is looked
        at again for up to ``settle_s``: a killed process of 500 MB takes seconds to exit on a loaded host (seen:
        stubs still exiting right after shutdown at load average 12-22), and one that never goes is reported."""
        deadline = time.monotonic() + settle_s
        while True:
            left = self._leftovers()
            if not any(left.values()) or time.monotonic() >= deadline:
                return left
            time.sleep(0.5)

    def _leftovers(self) -> dict:
        boards = self.servers[0].settings.service.admission_dir  # the same for every server
        live_pgids = {s.proc.pid for s in self.servers if s.proc is not None}
        live_shm = {s.shm_prefix for s in self.servers if s.proc is not None}
        if self.router is not None and self.router.poll() is None:
            live_pgids.add(self.router.pid)
        live_ports = set()
        for s in self.servers:
            if s.proc is not None:
                live_ports |= {s.grpc_port, s.http_port, s.metrics_port}
        if self.router is not None and self.router.poll() is None:
            live_ports |= {self.router_port, self.http_port}
        return {
            "processes": [f"{p.pid}:{footprint.label(p)}" for g in self.seen.get("pgids", set()) - live_pgids
                          for p in footprint.group_members(g)],
            "shm_regions": [r for pre in self.seen.get("shm", set()) - live_shm for r in footprint.shm_regions(pre)] +
                           [str(p) for g in self.seen.get("pgids", set()) - live_pgids
                            if (p := admission.board_path(boards, g)).exists()],
            "ports": sorted(p for p in self.seen.get("ports", set()) - live_ports if footprint.port_in_use(p)),
        }

    def pgids(self) -> dict[str, int]:
        out = {f"server{i}": s.proc.pid for i, s in enumerate(self.servers) if s.proc is not None}
        if self.router is not None and self.router.poll() is None:
            out["router"] = self.router.pid
        return out


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def running_topology(instances: int, out: Path, env: dict | None = None, router_args: list | None = None,
                     keys: bool = False):
    """``instances`` supervised Triton servers and the router process in front of them (``keys``: with a key
    file; the load's key in ``topo.api_key``; the backends then take calls from the router only, and so whenever
    API keys are on: ``cluster.backend_env``). SIGTERM and SIGINT end
    the run through the clean-up (a background job starts with SIGINT ignored; the servers live in their own
    sessions and would outlive a plain kill of this process)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    router_args = list(router_args or [])
    env = {**(env or {}), **backend_env(out, env, keys=keys or "--api-keys-file" in router_args)}
    key = load_settings({**os.environ, **env}).security.backend_key_file  # the router reads the rest of them itself
    router_args = (["--backend-key-file", str(key)] if key else []) + router_args
    try:
        with _running(instances, out, env, router_args) as topo:
            if keys:
                with topo.keys_on():
                    yield topo
            else:
                yield topo
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _running(instances: int, out: Path, env: dict | None, router_args: list):
    with running_backends(instances, out, env, supervise=True) as (servers, supervisor):
        topo = Topology(servers, supervisor, out, router_args=router_args)
        topo.remember()
        try:
            topo.start_router()
            yield topo
        finally:
            topo.stop_router()
            topo.remember()
    # running_backends stopped the servers here; the caller checks ``topo.leftovers()``
