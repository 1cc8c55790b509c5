"""Keeps the launcher's Triton instances running: a dead backend's whole process group is reaped and the
instance restarted, with back-off.

A backend counts as dead when its ``tritonserver`` exited, or when one of the Python-backend stubs it started
has gone (Triton 2.51 does not restart a crashed stub and keeps saying ready, answering every request to that
model with an error). Reaping kills what is left of its process group (the stubs are reparented to PID 1 when
the server dies and would keep their memory), waits for every member to be gone, and removes its
shared-memory regions; only then is it started again, on the same ports, so the router keeps its address. The
router takes the instance back only after a real request succeeds on it (see ``Backend``); the supervisor does
not talk to the router. A server that is stopped (SIGSTOP) is not dead: the router's health checks handle a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import psutil

from maskedit.launcher import TritonServer
from maskedit_common import logs

log = logging.getLogger("maskedit.supervisor")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # wait before the n-th restart in a row; reset once it stays up
STABLE_S = 60.0  # up this long: the next failure starts the back-off again


@dataclass
class Instance:
    server: TritonServer
    stubs: dict = field(default_factory=dict)  # pid -> (psutil.Process, model) of its Python-backend stubs
    restarts: int = 0  # in a row, for the back-off
    total_restarts: int = 0
    up_since: float = 0.0
    events: list = field(default_factory=list)  # (wall time, what) for reports


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` (zombies excluded: they hold no memory, only a pid)."""
    out = []
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def stubs_of(server: TritonServer) -> dict:
    """The server's Python-backend stub processes (its children) and the model each serves, by pid."""
    with contextlib.suppress(psutil.Error):
        return {c.pid: (c, _model_of(c)) for c in psutil.Process(server.proc.pid).children(recursive=True)}
    return {}


def why_dead(inst: Instance) -> str | None:
    """Why this instance can no longer serve, or None."""
    proc = inst.server.proc
    if proc is None:  # stopped by its owner on purpose: not the supervisor's to restart
        return None
    code = proc.poll()  # reaps the server if it exited
    if code is not None:
        return f"tritonserver exited with {code}"
    for pid, (p, model) in inst.stubs.items():
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                return f"stub {pid} ({model}) died"
        except psutil.NoSuchProcess:
            return f"stub {pid} ({model}) died"
    return None


def _model_of(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return next((a for a in p.cmdline() if a.endswith("_0_0")), p.name())
    return "?"


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
                 stable_s: float = STABLE_S, start_timeout_s: float = 300.0):
        self.instances = [Instance(s, stubs_of(s), up_since=time.monotonic()) for s in servers]
        self.check_s, self.backoff, self.stable_s, self.start_timeout = check_s, tuple(backoff_s), stable_s, \
            start_timeout_s
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
                 "restarts": i.total_restarts, "events": list(i.events)} for i in self.instances]

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            for inst in self.instances:
                why = why_dead(inst)
                if why is not None:
                    self._restart(inst, why)
                elif inst.restarts and time.monotonic() - inst.up_since > self.stable_s:
                    inst.restarts = 0

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
            inst.events.append((time.time(), f"restarted as pid {s.proc.pid}"))
            logs.event(log, "backend restarted", logging.WARNING, grpc=s.grpc_url, pid=s.proc.pid,
                       after_s=round(delay, 1), restarts=inst.total_restarts)
            return
