"""What a benchmark's host is doing besides the benchmark: CPU busy on the whole host against the CPU of the
processes under test, once a second, in a background thread.

A measurement on a shared 2-core host drifts with whatever else runs (another job, the harness itself, memory
pressure). The validation replays its runs in a simulator that models only the instances; recording the rest lets
a replay feed it in (``foreign_cores``) and lets a reader tell a modelling error from a disturbance."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import psutil


def _vmstat(name: str) -> int | None:
    """A counter from /proc/vmstat (Linux only; None elsewhere)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                k, v = line.split()
                if k == name:
                    return int(v)
    except OSError:
        return None
    return None


def _label(p: psutil.Process) -> str:
    """What a tested process is: a Triton Python stub's model, else its process name."""
    from .supervisor import stub_of

    if "python_backend_stub" in p.name():
        return stub_of(p).model
    return p.name()


def _who(p: psutil.Process) -> str:
    """What a process outside the tested ones is, for ``foreign_top``: this harness, a Python program by its module
    or script (the router, a load generator), else its process name (a kernel thread such as ``kworker/...``: page
    writeback shows there)."""
    if p.pid == os.getpid():
        return "this harness"
    name = p.name()
    if name.startswith("kworker"):  # its name follows the work item it runs now: all of them as one
        return "kworker"
    if name.startswith("python"):
        try:
            argv = p.cmdline()
        except psutil.Error:
            return name
        if "-m" in argv[:-1]:
            return argv[argv.index("-m") + 1]
        if len(argv) > 1 and argv[1] != "-c":
            return os.path.basename(argv[1])
    return name


FOREIGN_TOP = 3  # the largest foreign CPU users named in each sample


class HostSampler:
    """Samples every ``interval_s``: ``busy_cores`` (the host's CPU in use, in cores), ``tested_cores`` (the CPU of
    the processes ``pids()`` names and all their descendants), ``foreign_cores`` (the difference: everything the
    processes under test did not use, this harness included), major page faults and swap pages per second, and
    memory available; ``foreign_top``: the largest users of the foreign CPU by what they are (``_who``);
    ``by_model``: the tested CPU split by what each process is (a Triton Python stub by its
    model, summed over the instances: ``masked_denoise``, ``preprocess``, ...; any other by its process name), so a
    slow stretch can be pinned on a stage. ``t`` is ``time.monotonic()`` at the sample's end; each sample covers the
    interval before it."""

    def __init__(self, pids: Callable[[], list[int]], interval_s: float = 1.0):
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[dict] = []
        self._procs: dict[int, psutil.Process] = {}
        self._labels: dict[tuple[int, float], str] = {}  # (pid, start time) -> what it is: ``by_model``
        self._who: dict[tuple[int, float], str] = {}  # (pid, start time) -> what it is: ``foreign_top``
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-sampler", daemon=True)

    def __enter__(self) -> HostSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)

    def _tested_cpu_s(self) -> dict[tuple[int, float], tuple[str, float]]:
        """(pid, start time) -> (what it is, user + system CPU so far) of the tested processes' trees (a pid reused
        by a new process is another key). A process that exits between two samples takes its last interval's CPU
        with it (rare: a stub restart)."""
        live: dict[int, psutil.Process] = {}
        for pid in self.pids():
            try:
                root = self._known(pid) or psutil.Process(pid)
                live[pid] = root
                for c in root.children(recursive=True):
                    live[c.pid] = self._known(c.pid) or c
            except psutil.Error:
                continue
        self._procs = live
        out: dict[tuple[int, float], tuple[str, float]] = {}
        for pid, p in live.items():
            try:
                key, t = (pid, p.create_time()), p.cpu_times()
                out[key] = (self._labels.get(key) or _label(p), t.user + t.system)
            except psutil.Error:
                continue
        self._labels = {key: label for key, (label, _) in out.items()}  # those gone are forgotten
        return out

    def _known(self, pid: int) -> psutil.Process | None:
        """The process already seen as ``pid``, if it is still that one (not a new process given a reused pid)."""
        p = self._procs.get(pid)
        return p if p is not None and p.is_running() else None

    def _foreign_cpu_s(self, tested: set[int]) -> dict[tuple[int, float], tuple[str, float]]:
        """(pid, start time) -> (what it is, user + system CPU so far) of every other process on the host (kernel
        threads included; a pid reused by a new process is another key, as in ``_tested_cpu_s``)."""
        out: dict[tuple[int, float], tuple[str, float]] = {}
        for p in psutil.process_iter(["create_time", "cpu_times"]):
            if p.pid in tested or p.info["cpu_times"] is None:
                continue
            key = (p.pid, p.info["create_time"])
            try:
                label = self._who.get(key) or _who(p)
            except psutil.Error:
                continue
            t = p.info["cpu_times"]
            out[key] = (label, t.user + t.system)
        self._who = {key: label for key, (label, _) in out.items()}  # those gone are forgotten
        return out

    @staticmethod
    def _busy_s() -> float:
        t = psutil.cpu_times()._asdict()  # guest time is already inside user on Linux: not added twice
        return sum(t.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))

    def _read(self) -> tuple:
        swap = psutil.swap_memory()
        tested = self._tested_cpu_s()
        return (time.monotonic(), self._busy_s(), tested, _vmstat("pgmajfault"), swap.sin + swap.sout,
                self._foreign_cpu_s({pid for pid, _ in tested}))

    def _loop(self) -> None:
        prev = self._read()
        while not self._stop.wait(self.interval_s):
            cur = self._read()
            dt = cur[0] - prev[0]
            # per process: one that appeared since the last sample counts from its start; one that exited is left out
            by: dict[str, float] = {}
            for key, (label, cpu) in cur[2].items():
                by[label] = by.get(label, 0.0) + (cpu - prev[2].get(key, (label, 0.0))[1]) / dt
            busy, tested = (cur[1] - prev[1]) / dt, sum(by.values())
            others: dict[str, float] = {}
            for key, (label, cpu) in cur[5].items():
                if key in prev[5]:  # one born since the last sample: its CPU before it is not this interval's
                    others[label] = others.get(label, 0.0) + (cpu - prev[5][key][1]) / dt
            self.samples.append({
                "t": cur[0], "busy_cores": round(busy, 3), "tested_cores": round(tested, 3),
                "by_model": {k: round(v, 3) for k, v in sorted(by.items()) if v >= 0.001},
                "foreign_cores": round(max(0.0, busy - tested), 3),
                "foreign_top": {k: round(v, 3) for k, v in
                                sorted(others.items(), key=lambda kv: -kv[1])[:FOREIGN_TOP] if v >= 0.01},
                "majfault_per_s": None if cur[3] is None or prev[3] is None else round((cur[3] - prev[3]) / dt, 1),
                "swap_bytes_per_s": round((cur[4] - prev[4]) / dt),
                "mem_available_gib": round(psutil.virtual_memory().available / 2**30, 2)})
            prev = cur

    def between(self, start: float, end: float) -> list[dict]:
        """The samples taken in [start, end] (monotonic seconds), ``t`` made relative to ``start``."""
        return [{**s, "t": round(s["t"] - start, 3)} for s in list(self.samples) if start <= s["t"] <= end]
