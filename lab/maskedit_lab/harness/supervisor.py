"""Keeps the launcher's Triton instances running: a dead model is reloaded alone, a dead server's whole process
group is reaped and the instance restarted, with back-off.

A backend counts as dead when its ``tritonserver`` exited, or when one of the Python-backend stubs it started
has gone (Triton 2.51 does not restart a crashed stub and keeps saying ready, answering every request to that
model with an error). A server started in explicit model-control mode (``RELOADABLE_ARGS``) gets the dead stub's
model reloaded through Triton's model-control API (``reload_model``): a new stub for that model only, while the
others keep their state — measured ~3x faster than a restart of every model (docs/reliability.md). The dead stub's
shared-memory region is removed. A reload that fails or times out, or a model that keeps dying (``MAX_RELOADS`` in
a row), falls back to the restart of the whole server: reaping kills what is left of its process group (the stubs
are reparented to PID 1 when the server dies and would keep their memory), waits for every member to be gone, and
removes its shared-memory regions; only then is it started again, on the same ports, so the router keeps its
address. The router takes the instance back only after a real request succeeds on it (see ``Backend``); the
supervisor does not talk to the router. A server that is stopped (SIGSTOP) is not dead: the router's health checks
handle a hang.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import psutil

from maskedit.launcher import TritonServer
from maskedit_common import logs

log = logging.getLogger("maskedit.supervisor")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # wait before the n-th restart in a row; reset once it stays up
STABLE_S = 60.0  # up this long: the next failure starts the back-off again
# Triton flags that let the supervisor reload one model of a running server (every model still loaded at start)
RELOADABLE_ARGS = ("--model-control-mode=explicit", "--load-model=*")
MAX_RELOADS = 3  # reloads in a row (none of them up STABLE_S) before the whole server is restarted instead
RELOAD_TIMEOUT_S = 300.0  # as long as a restart may take to start: a reload is never the slower way
GENERATION = "maskedit_generation"  # the config parameter a reload changes (see ``reload_model``)


class Stub(NamedTuple):
    """One Python-backend stub process: the model instance it serves (``masked_denoise_0_0``), its model and the
    shared-memory region it was started with (read from its command line while it lives)."""

    proc: psutil.Process
    instance: str
    model: str
    region: str | None


@dataclass
class Instance:
    server: TritonServer
    stubs: dict = field(default_factory=dict)  # pid -> Stub of its Python-backend stubs
    restarts: int = 0  # in a row, for the back-off
    total_restarts: int = 0
    reloads: int = 0  # model reloads in a row
    total_reloads: int = 0
    up_since: float = 0.0
    events: list = field(default_factory=list)  # (wall time, what) for reports

    @property
    def recoveries(self) -> int:
        """Restarts and model reloads so far: one more each time the supervisor brought it back."""
        return self.total_restarts + self.total_reloads


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` (zombies excluded: they hold no memory, only a pid)."""
    out = []
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def stubs_of(server: TritonServer) -> dict:
    """The server's live Python-backend stub processes (its children) by pid (a stub killed earlier and reloaded
    stays a zombie child of the server: not counted)."""
    out = {}
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(server.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if c.status() != psutil.STATUS_ZOMBIE:
                    out[c.pid] = stub_of(c)
    return out


def stub_of(p: psutil.Process) -> Stub:
    """The stub's command line: ``<stub> <model dir>/<version>/model.py <shm region> <sizes> ... <instance> ...``."""
    try:
        args = p.cmdline()
    except psutil.Error:
        return Stub(p, "?", "?", None)
    instance = next((a for a in args if re.search(r"_\d+_\d+$", a)), p.name())
    model_py = next((a for a in args if a.endswith(".py")), None)
    model = Path(model_py).parent.parent.name if model_py else re.sub(r"_\d+_\d+$", "", instance)
    region = next((a for a in args[1:] if a.startswith("maskedit_tpb_")), None)
    return Stub(p, instance, model, region)


def dead_stub(inst: Instance) -> Stub | None:
    """A stub of the instance that has gone, if any."""
    for stub in inst.stubs.values():
        try:
            if not stub.proc.is_running() or stub.proc.status() == psutil.STATUS_ZOMBIE:
                return stub
        except psutil.NoSuchProcess:
            return stub
    return None


def why_dead(inst: Instance) -> str | None:
    """Why this instance can no longer serve, or None."""
    proc = inst.server.proc
    if proc is None:  # stopped by its owner on purpose: not the supervisor's to restart
        return None
    code = proc.poll()  # reaps the server if it exited
    if code is not None:
        return f"tritonserver exited with {code}"
    stub = dead_stub(inst)
    return None if stub is None else f"stub {stub.proc.pid} ({stub.instance}) died"


def reloadable(server: TritonServer) -> bool:
    """Started in explicit model-control mode: one model can be reloaded without the others."""
    return all(a in getattr(server, "extra_args", ()) for a in RELOADABLE_ARGS)


def reload_model(server: TritonServer, model: str, timeout_s: float = RELOAD_TIMEOUT_S) -> None:
    """Load ``model`` again on the running ``server`` (Triton's model-control API; raises on failure or timeout).
    Triton reloads a loaded model only when its files or its configuration changed, and answers at once
    otherwise: the current configuration with a fresh ``maskedit_generation`` parameter makes it start a new
    instance (a new stub) of the same files and retire the dead one; the ensemble keeps serving through it."""
    base = f"http://{server.http_url}/v2"
    with urllib.request.urlopen(f"{base}/models/{model}/config", timeout=10) as r:
        config = json.loads(r.read())
    config.setdefault("parameters", {})[GENERATION] = {"string_value": uuid.uuid4().hex[:12]}
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    req = urllib.request.Request(f"{base}/repository/models/{model}/load", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def reap(server: TritonServer, timeout_s: float = 10.0) -> int:
    """Kill what is left of ``server``'s process group, wait until none of it is alive, remove its
    shared-memory regions; returns how many processes were killed."""
    pgid = server.proc.pid if server.proc is not None else None
    killed = 0
    if pgid is not None:
        members = group_members(pgid)
        killed = len(members)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        # the server itself is our child: ``server.stop`` waits for it (psutil would reap it behind Popen's back)
        psutil.wait_procs([p for p in members if p.pid != pgid], timeout=timeout_s)
    server.stop(timeout=0.1)  # waits for (reaps) the server, unlinks its /dev/shm regions
    return killed


class Supervisor:
    """Watches ``servers`` from a thread; ``stop()`` before stopping the servers themselves."""

    def __init__(self, servers: list[TritonServer], check_s: float = 0.5, backoff_s=BACKOFF_S,
                 stable_s: float = STABLE_S, start_timeout_s: float = 300.0,
                 reload_timeout_s: float = RELOAD_TIMEOUT_S):
        self.instances = [Instance(s, stubs_of(s), up_since=time.monotonic()) for s in servers]
        self.check_s, self.backoff, self.stable_s, self.start_timeout = check_s, tuple(backoff_s), stable_s, \
            start_timeout_s
        self.reload_timeout = reload_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="supervisor")

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.start_timeout + 30)

    def status(self) -> list[dict]:
        return [{"grpc": i.server.grpc_url, "pid": i.server.proc.pid if i.server.proc else None,
                 "restarts": i.total_restarts, "reloads": i.total_reloads, "events": list(i.events)}
                for i in self.instances]

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            for inst in self.instances:
                why = why_dead(inst)
                if why is not None:
                    stub = dead_stub(inst) if inst.server.proc.poll() is None else None
                    if stub is None or not self._reload(inst, stub):
                        self._restart(inst, why)
                elif (inst.restarts or inst.reloads) and time.monotonic() - inst.up_since > self.stable_s:
                    inst.restarts = inst.reloads = 0

    def _reload(self, inst: Instance, stub: Stub) -> bool:
        """Reload the model of ``stub`` (dead) alone; False when the server cannot, or it did not work (the caller
        restarts the whole server then)."""
        s = inst.server
        if not reloadable(s) or inst.reloads >= MAX_RELOADS:
            return False
        t0 = time.monotonic()
        inst.events.append((time.time(), f"stub {stub.proc.pid} ({stub.instance}) died; reloading {stub.model}"))
        try:
            reload_model(s, stub.model, self.reload_timeout)
        except Exception as e:  # refused, timed out, the server hung: the restart is the last resort
            inst.events.append((time.time(), f"reload of {stub.model} failed: {str(e).splitlines()[0][:200]}"))
            logs.event(log, "model reload failed; restarting the server", logging.WARNING, grpc=s.grpc_url,
                       model=stub.model, error=str(e)[:200])
            return False
        inst.stubs, inst.up_since = stubs_of(s), time.monotonic()
        if stub.region:  # the dead stub cannot unlink its region, and Triton leaves it
            with contextlib.suppress(OSError):
                (Path("/dev/shm") / stub.region).unlink()
        inst.reloads += 1
        inst.total_reloads += 1
        took = time.monotonic() - t0
        inst.events.append((time.time(), f"reloaded {stub.model} in {took:.1f} s"))
        logs.event(log, "model reloaded", logging.WARNING, grpc=s.grpc_url, model=stub.model, dead_pid=stub.proc.pid,
                   took_s=round(took, 1), reloads=inst.total_reloads)
        return dead_stub(inst) is None

    def _restart(self, inst: Instance, why: str) -> None:
        """Reap, wait the back-off, start again; a start that fails is reaped and retried after a longer wait.
        Instances are restarted one at a time (a restart is rare; a second dead one waits its turn)."""
        s = inst.server
        while not self._stop.is_set():
            killed = reap(s)
            inst.events.append((time.time(), f"reaped: {why} ({killed} processes killed)"))
            logs.event(log, "backend reaped", logging.WARNING, grpc=s.grpc_url, why=why, killed=killed)
            delay = self.backoff[min(inst.restarts, len(self.backoff) - 1)]
            inst.restarts += 1
            if self._stop.wait(delay):
                return
            try:
                s.start(timeout=self.start_timeout)
            except Exception as e:  # ports still held, model failed to load, ...: back off and try again
                why = f"restart failed: {str(e).splitlines()[0]}"
                continue
            inst.stubs, inst.up_since = stubs_of(s), time.monotonic()
            inst.total_restarts += 1
            inst.reloads = 0
            inst.events.append((time.time(), f"restarted as pid {s.proc.pid}"))
            logs.event(log, "backend restarted", logging.WARNING, grpc=s.grpc_url, pid=s.proc.pid,
                       after_s=round(delay, 1), restarts=inst.total_restarts)
            return
