"""Bringing a hit's cached rows to the model's device ahead of the blocks that use them.

At the start of a step ``start_step`` queues every row the batch's hits will need, in block order, on one
background thread: block ``i``'s rows are in flight while block ``i-1`` computes. A block asks for its rows with
``rows(jc, step)(b, kind)``; it blocks only if the loader has not reached that block yet.

A stored entry's rows are verified (``integrity``: a checksum over every chunk, every time) before they are copied.
One thread hashes at ~6-10 GB/s; a GPU takes a block's rows at ~55 GB/s (an H200's page-locked copies, 0.45 ms for
a FLUX.1 block's 25 MB). On the H200 the loader thread alone spent ~4 ms a block, the step waited on it and the
cached modes ran slower than full computation (docs/gpu.md). So on a GPU the next blocks' rows are verified on a
small pool of threads (xxhash releases the GIL) while the loader thread copies in block order.

Loads a step will not read are cancelled (temporal reuse skipping a hit's middle blocks, a request leaving the
batch): the loader passes them over at once, and a new step releases the previous step's window, so rows queued for
blocks that never start (a UNet step skipping every transformer block) hold neither the loader nor the next step.

On a GPU the copies run on a dedicated copy stream from page-locked memory: a stored entry's mapping is registered
with CUDA once (``device.pin_in_place``: DMA straight from the shared-memory file, no CPU copy), a template run in
progress is read from its recorder's pinned buffers after that step's device-to-host copies (an event). Each load
ends with an event; the block's stream waits on its own rows' event only (GPU-side, no host synchronisation).
On the CPU a load is one contiguous copy out of the mapping, as the block would otherwise make.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import SideStream, is_cuda, pin_in_place, wait

Y_ROWS, K_BUF, V_BUF = "y", "kbuf", "vbuf"  # a block's recorded output rows; its keys / values buffers


@dataclass
class Loaded:
    tensor: torch.Tensor  # on the model's device
    event: object = None  # CUDA: the copy's completion on the copy stream


class _Window:
    """How far the loader may run ahead of the blocks of one step: at most ``ahead`` blocks of rows are on the
    device before the blocks that use them (a whole step's rows of a Flux-size hit are gigabytes). A wait ends early
    when its load is cancelled and gives up after ``patience`` seconds (a stall), so a step that failed half-way
    never blocks the loader for good."""

    DONE = 1 << 30  # ``reached`` once the step is over: nothing waits for its blocks any more

    def __init__(self, ahead: int, patience: float = 1.0):
        self.ahead, self.patience, self.reached_block = ahead, patience, -1
        self._cv = threading.Condition()

    def wait_for(self, block: int, fut: Future) -> bool:
        """Wait until ``block``'s rows may load or ``fut`` is cancelled; False when it gave up (a stall)."""
        with self._cv:
            return self._cv.wait_for(lambda: fut.cancelled() or self.reached_block >= block - self.ahead,
                                     timeout=self.patience)

    def reached(self, block: int) -> None:
        with self._cv:
            if block > self.reached_block:
                self.reached_block = block
                self._cv.notify_all()

    def cancelled(self, fut: Future) -> None:
        """A queued load's done-callback: a cancelled one wakes the loader if it waits for that load's block."""
        if fut.cancelled():
            with self._cv:
                self._cv.notify_all()


def usable_cores() -> int:
    """The cores this process may use: its CPU set (a container's, not the host's count), and no more than its
    cgroup's CPU quota (a Kubernetes CPU limit is a quota, not a CPU set), rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """This process's CPU quota in cores: the tightest along its cgroup's path (v2 ``cpu.max``; v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), None when there is none or it cannot be read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy
            found += _along(root, path, lambda d: _read_quota((d / "cpu.max").read_text().split()))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            base = root / controllers
            base = base if base.is_dir() else root / "cpu"
            found += _along(base, path, lambda d: _read_quota([(d / "cpu.cfs_quota_us").read_text().strip(),
                                                               (d / "cpu.cfs_period_us").read_text().strip()]))
    found = [q for q in found if q]
    return min(found) if found else None


def _along(base: Path, path: str, read) -> list:
    """``read`` of every directory from the cgroup's own up to ``base`` (a parent's quota bounds its children)."""
    out, d = [], base / path.strip().lstrip("/")
    while True:
        try:
            out.append(read(d))
        except (OSError, ValueError, IndexError):
            pass
        if d == base or base not in d.parents:
            return out
        d = d.parent


def _read_quota(fields: list[str]) -> float | None:
    quota, period = fields[0], fields[1]
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period) if int(period) > 0 and int(quota) > 0 else None


def default_verify_threads(cuda: bool) -> int:
    """Threads verifying rows ahead of the copies: on a GPU, half the usable cores up to 8 (a copy outruns one
    thread's hashing ~6x); on the CPU none beside the loader (the denoise computation has the cores, and a CPU copy
    costs as much as the hash)."""
    return max(1, min(8, usable_cores() // 2)) if cuda else 1


_verify_pools: dict[int, ThreadPoolExecutor] = {}
_verify_pools_mu = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child inherits the pools without their threads: it makes its own
    os.register_at_fork(after_in_child=_verify_pools.clear)
log = logging.getLogger("maskedit.cache")


def verify_pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` verify threads: every loader of that size shares it (a process serving
    several runtimes, ControlNet ones included, runs one step at a time and would otherwise hold a pool for each)."""
    with _verify_pools_mu:
        pool = _verify_pools.get(threads)
        if pool is None:
            pool = _verify_pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="cache-verify")
        return pool


class RowLoader:
    def __init__(self, device, heads: int, head_dim: int, ahead_blocks: int = 8, verify_threads: int | None = None):
        self.ahead_blocks = ahead_blocks
        self.device = torch.device(device)
        self.cuda = is_cuda(self.device)
        self.heads, self.head_dim = heads, head_dim
        self._copy = SideStream.shared(self.device, "load")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cache-loader")
        n = default_verify_threads(self.cuda) if verify_threads is None else verify_threads
        # Verification runs at most 2n loads ahead of the copy (the one being copied included): enough to keep n
        # threads busy, little wasted on a request that leaves.
        self._verify = verify_pool(n) if n > 1 else None
        self.verify_ahead = 2 * n if n > 1 else 1
        self._inflight: deque = deque()  # (event, source) pairs: sources stay mapped until their copy is done
        self._mu = threading.Lock()  # the loader thread and inline loads both touch _inflight and page-locking
        self._window: _Window | None = None  # the latest step's
        self.stalls = 0  # waits for a block that gave up after the window's patience (none when blocks report)

    # -- the block side -----------------------------------------------------------------------------
    def start_step(self, hits: list, needed):
        """Queue the rows ``needed(jc, b)`` of every (JobCache, step) in ``hits``, in block order. Returns the
        callable the step calls as each block starts (``_Window.reached``), or None if nothing was queued."""
        if not hits:
            return None
        window = _Window(self.ahead_blocks)
        if self._window is not None:  # the previous step is over: its loads left queued need not wait for blocks
            self._window.reached(_Window.DONE)
        self._window = window
        work = self.new_futures(hits, needed)
        for fut, *_ in work:
            fut.add_done_callback(window.cancelled)
        self._pool.submit(self._run, work, window)
        return window.reached

    @staticmethod
    def new_futures(hits: list, needed) -> list:
        """A new future in ``jc.futures`` for each row ``needed(jc, b)`` of every (JobCache, step) in ``hits``, in
        block order, as (future, jc, step, block, kind)."""
        work = []
        for b in range(len(hits[0][0].modes) if hits else 0):
            for jc, step in hits:
                for kind in needed(jc, b):
                    stale = jc.futures.get((step, b, kind))  # a step retried after a failure: drop its old load
                    if stale is not None:
                        stale.cancel()
                    fut = jc.futures[(step, b, kind)] = Future()
                    work.append((fut, jc, step, b, kind))
        return work

    def rows(self, jc, step: int):
        """The getter a ``RowView`` calls from inside block ``b``: (b, kind) -> tensor on the device."""

        def get(b: int, kind: str) -> torch.Tensor:
            fut: Future | None = jc.futures.pop((step, b, kind), None)
            got = fut.result() if fut is not None else self.load(jc, step, b, kind)
            if got.event is not None:
                wait(got.event, self.device)  # this block waits for its own rows only, on the GPU
                got.tensor.record_stream(torch.cuda.current_stream(self.device))
            return got.tensor

        return get

    # -- the loader thread ----------------------------------------------------------------------------
    def _run(self, work, window: _Window) -> None:
        pending = deque(work)  # consumed rows are not kept alive by this
        work.clear()
        ahead: deque = deque()  # (load, its verification's future or None), in block order
        fut = None
        try:
            while pending or ahead:
                while pending and len(ahead) < self.verify_ahead:
                    item = pending[0]  # left in pending until it is in ahead: a refused submit loses no load
                    ahead.append((item, None if self._verify is None or item[0].cancelled()
                                  else self._verify.submit(self._verify_rows, *item[1:])))
                    pending.popleft()
                (fut, jc, step, b, kind), src = ahead.popleft()
                if not fut.cancelled() and not window.wait_for(b, fut):
                    self.stalls += 1
                if not fut.set_running_or_notify_cancel():  # its request left the batch, or its block is skipped
                    if src is not None:
                        src.cancel()
                    continue
                try:
                    if src is not None:
                        src.result()  # raises the verification's CorruptEntry
                    fut.set_result(self.load(jc, step, b, kind, verified=src is not None))
                except BaseException as e:  # the block that needs it re-raises it (its request fails, not the loop)
                    fut.set_exception(e)
        except BaseException as e:  # the loop itself broke (no new futures at interpreter exit): no block may wait
            err = RuntimeError(f"the row loader stopped: {e}")  # for a load nobody will make
            left = [fut] + [f for (f, *_), _src in ahead] + [f for f, *_ in pending]
            for (_f, *_), src in ahead:
                if src is not None:
                    src.cancel()
            for f in left:
                if f is not None and not f.done() and (f.running() or f.set_running_or_notify_cancel()):
                    f.set_exception(err)
            log.exception("the row loader stopped; the step's loads not made failed")
            raise

    @staticmethod
    def cancel(jc) -> None:
        """Drop ``jc``'s pending loads (it left the batch): the loader skips those not started."""
        for fut in jc.futures.values():
            fut.cancel()
        jc.futures.clear()

    @staticmethod
    def _where(jc, step: int, b: int, kind: str) -> tuple:
        """(array name, index) of one block's rows of ``jc``'s entry at ``step``."""
        m = jc.entry.meta
        if m.get("layout") == "per_block":  # a UNet's blocks differ in size: one array per block, (R, N_b, D_b)
            return f"{kind[0]}.{b}", (step,)
        if kind == Y_ROWS:
            return "y", (step, m["y_blocks"].index(b))  # (N, D)
        return kind[0], (step, m["kv_blocks"].index(b))  # (N, inner)

    def _verify_rows(self, jc, step: int, b: int, kind: str) -> None:
        """On a verify thread: check the rows' chunks against a stored entry's checksums (raises ``CorruptEntry``;
        a template run in progress has none: its rows are this process's own memory). Hashing only: making the
        tensor view is left to the loader thread (``as_tensor`` touches the process-wide warning filters)."""
        verify = getattr(jc.entry, "verify", None)
        if verify is not None:
            name, index = self._where(jc, step, b, kind)
            verify(name, *index)

    def load(self, jc, step: int, b: int, kind: str, verified: bool = False) -> Loaded:
        """Copy one block's rows of ``jc``'s entry at ``step`` to the device (into a keys/values buffer whose
        text part the block fills), verifying them first unless ``verified`` (``_verify_rows`` did)."""
        t0 = time.perf_counter()
        entry = jc.entry
        name, index = self._where(jc, step, b, kind)
        # ``rows`` verifies the chunks it returns (a stored entry's checksums; raises ``CorruptEntry``).
        src = entry.tensor(name)[index] if verified else entry.rows(name, *index)
        with self._copy.use():
            if kind == Y_ROWS:
                out = dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            else:
                rows = src if src.dim() == 3 else src[None]  # (R, N, inner): one per guidance row
                r, n, inner = rows.shape
                out = torch.empty((r, jc.text_len + n, inner // self.head_dim, self.head_dim), dtype=src.dtype,
                                  device=self.device)
                dst = out[:, jc.text_len:].flatten(-2)
                src = rows
            self._copy_in(dst, src, entry, step)
            event = self._copy.mark()
        if event is not None:
            with self._mu:
                self._inflight.append((event, entry))
                while self._inflight and self._inflight[0][0].query():
                    self._inflight.popleft()
        jc.load_s += time.perf_counter() - t0
        return Loaded(out, event)

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, entry, step: int) -> None:
        if not self.cuda:
            dst.copy_(src)
            return
        ready = getattr(entry, "step_event", None)  # a template run in progress: its copies of this step
        if ready is not None:
            ev = ready(step)
            if ev is not None:
                self._copy.stream.wait_event(ev)
        with self._mu:
            locked = self._page_locked(entry)
        if locked:
            dst.copy_(src, non_blocking=True)
        else:  # staging through a pinned buffer (the host allocator reuses it once this copy is done)
            staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            staging.copy_(src)
            dst.copy_(staging, non_blocking=True)

    @staticmethod
    def _page_locked(entry) -> bool:
        """Is the entry's memory pinned? A recording's buffers are; a stored entry's mapping is registered on first
        use (remembered on the entry, which the store keeps while the file is unchanged)."""
        pinned = getattr(entry, "pinned", None)
        if pinned is None:
            mapping = getattr(entry, "mapping", None)
            pinned = entry.pinned = mapping is not None and pin_in_place(mapping)
        return pinned

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # the verify pool is the process's (``verify_pool``): it stays
