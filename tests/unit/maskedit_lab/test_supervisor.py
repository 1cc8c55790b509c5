"""The supervisor's view of a backend: dead when its server exited or one of its stubs died; reaping leaves no
process of its group and no shared-memory region. Real processes (a shell standing in for tritonserver, its
children for the stubs); the integration chaos tests do the same with real Triton servers."""

import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from maskedit_lab.supervisor import Instance, group_members, reap, stubs_of, why_dead


class _Server:
    """What the supervisor uses of a TritonServer: proc, shm_prefix, stop()."""

    def __init__(self):
        self.proc = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
        self.shm_prefix = f"maskedit_test_{os.getpid()}_{id(self)}"
        (Path("/dev/shm") / f"{self.shm_prefix}_region").write_bytes(b"x")
        deadline = time.monotonic() + 5
        while len(psutil.Process(self.proc.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, timeout=0.1):
        if self.proc is not None:
            self.proc.wait(5)
            for r in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
                r.unlink()
            self.proc = None


def test_a_dead_stub_makes_the_backend_dead_and_reaping_leaves_nothing():
    s = _Server()
    pgid = s.proc.pid
    try:
        inst = Instance(s, stubs_of(s))
        assert len(inst.stubs) == 2 and why_dead(inst) is None
        victim = next(iter(inst.stubs))
        os.kill(victim, 9)
        deadline = time.monotonic() + 5
        while why_dead(inst) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"stub {victim}" in why_dead(inst)
        assert reap(s) >= 2  # the server and the surviving stub
        assert group_members(pgid) == [] and not list(Path("/dev/shm").glob(f"{s.shm_prefix}*"))
    finally:
        if s.proc is not None:
            os.killpg(pgid, 9)
            s.stop()


def test_a_server_stopped_by_its_owner_is_left_alone():
    assert why_dead(Instance(SimpleNamespace(proc=None))) is None
