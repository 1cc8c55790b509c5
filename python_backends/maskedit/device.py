"""What differs between a CUDA GPU and the CPU, in one place: pinned host buffers, side streams for copies,
events that order work across streams without a host sync, and timings that are true on the device.

On the CPU every operation is synchronous, so streams and events reduce to nothing and the wall clock is the
device's clock. On CUDA the host only queues work: a host timer measures when kernels were *queued*, so durations
come from CUDA events, read once the GPU has passed them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(settings) -> torch.dtype:
    """The dtype a model is served in (``MASKEDIT_DTYPE``)."""
    return _DTYPES[settings.dtype]


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def host_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A host buffer for rows going to or coming from ``device``: page-locked when that is a GPU, so copies are real
    DMA and asynchronous; plain memory on the CPU (lazily paged in, as before).

    On a GPU the buffer is exactly its size, page-locked in place and unlocked when it is freed: PyTorch's pinned
    allocator would round a multi-GB recording up to the next power of two and keep it cached after use. If CUDA
    refuses to lock it, the pinned allocator is the fallback."""
    if not is_cuda(device):
        return torch.empty(shape, dtype=dtype)
    t = torch.empty(shape, dtype=dtype)
    return t if pin_in_place(t) else torch.empty(shape, dtype=dtype, pin_memory=True)


class SideStream:
    """A CUDA stream beside the compute stream (copies in or out of the device overlap with kernels), or, on the
    CPU, nothing: the work runs inline."""

    _shared: dict = {}

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = is_cuda(self.device)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    @classmethod
    def shared(cls, device, purpose: str) -> "SideStream":
        """One stream per device and purpose (e.g. "load", "record") for the whole process."""
        key = (str(torch.device(device)), purpose)
        if key not in cls._shared:
            cls._shared[key] = cls(device)
        return cls._shared[key]

    @contextlib.contextmanager
    def after(self, stream=None):
        """Run the enclosed work on this stream, ordered after what ``stream`` (default: the current stream of this
        thread) has queued so far."""
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(stream or torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def use(self):
        """Run the enclosed work on this stream, with no ordering against other streams (the caller adds events)."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def mark(self):
        """An event at the current end of this stream (None on the CPU: everything before it is already done)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def keep_alive(self, t: torch.Tensor) -> None:
        """``t`` was made on another stream and is used here: the allocator must not reuse it before we are done."""
        if self.cuda and t.is_cuda:
            t.record_stream(self.stream)


def wait(event, device=None) -> None:
    """Make this thread's current stream on ``device`` wait for ``event`` (GPU-side: the host does not block).
    No-op for None."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


# cudaHostRegister flags: portable (every context sees it as pinned) | read-only (entries are mapped PROT_READ).
_PORTABLE, _READ_ONLY = 0x01, 0x08
_cudart_lib = None


def _cudart():
    """The CUDA runtime library torch already loaded (found in this process's mappings, the major version torch
    was built with), through ctypes: torch's own binding of cudaHostRegister leaves a failure as the thread's last
    error, which a later kernel launch would then raise; here every failure is cleared with cudaGetLastError."""
    global _cudart_lib
    if _cudart_lib is None:
        import ctypes

        torch.cuda.init()
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
        major = (torch.version.cuda or "").split(".")[0]
        paths = [p for p in paths if f"libcudart.so.{major}" in p] or paths
        if not paths:
            raise OSError("libcudart is not loaded in this process")
        lib = ctypes.CDLL(paths[0])
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        _cudart_lib = lib
    return _cudart_lib


def _unregister(lib, ptr: int) -> None:
    if lib.cudaHostUnregister(ptr) != 0:
        lib.cudaGetLastError()  # whichever thread the collector runs on must not inherit the error


def pin_in_place(a) -> bool:
    """Page-lock the memory behind ``a`` (a mapped entry's buffer, a host tensor) so the GPU copies from it by DMA,
    with no CPU copy into a staging buffer. Unlocked again when ``a`` is garbage-collected. False if CUDA refused
    (then the caller uses PyTorch's pinned buffers)."""
    import weakref

    import numpy as np

    if isinstance(a, torch.Tensor):
        ptr, size, writable = a.data_ptr(), a.numel() * a.element_size(), True
    else:
        buf = np.asarray(a)
        ptr, size, writable = buf.ctypes.data, buf.nbytes, buf.flags.writeable
    if size == 0:
        return False
    try:
        lib = _cudart()
        err = lib.cudaHostRegister(ptr, size, _PORTABLE | (0 if writable else _READ_ONLY))
        if err != 0:
            lib.cudaGetLastError()  # clear it: the next kernel launch on this thread would report it
            log.warning("cudaHostRegister of %d bytes failed (error %d); using staging buffers", size, err)
            return False
    except (OSError, AttributeError) as e:
        log.warning("cannot page-lock host memory in place (%s); using staging buffers", e)
        return False
    weakref.finalize(a, _unregister, lib, ptr)
    return True


def time_mark(device):
    """A point in time on ``device``: the wall clock on the CPU; on a GPU a timing event recorded on this thread's
    current stream (the host only queues kernels there, so its clock says when they were queued, not run)."""
    if not is_cuda(device):
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True, blocking=True)  # waiting on it yields the core, no spinning
    ev.record(torch.cuda.current_stream(torch.device(device)))
    return ev


def seconds_between(start, end, wait: bool = False) -> float | None:
    """Seconds from ``start`` to ``end`` (two ``time_mark`` results); None if a GPU has not passed ``end`` yet,
    unless ``wait``."""
    if isinstance(start, float):
        return end - start
    if wait:
        end.synchronize()
    elif not end.query():
        return None
    return start.elapsed_time(end) / 1000.0


def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError)


def device_lost(e: BaseException) -> bool:
    """A CUDA error that poisons the context (an illegal address, a device-side assert, ...): every later call on
    the device fails too, so nothing can be retried in this process. Out-of-memory is not one of them."""
    if out_of_memory(e):
        return False
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or "CUDA error" in str(e)


def release_cached_memory(device) -> None:
    """Give the caching allocator's free blocks back (after an out-of-memory error, before retrying)."""
    if is_cuda(device):
        torch.cuda.empty_cache()


def synchronize(device) -> None:
    """Wait until ``device`` has finished everything queued (a no-op on the CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


@dataclass
class _Span:
    tokens: int
    start: object  # CUDA event or perf_counter seconds
    end: object


class StepClock:
    """Device-true step durations without stalling the host at every step.

    ``begin``/``end`` bracket a step; ``finished()`` returns (tokens, seconds) of the steps the device has completed
    since the last call. On CUDA that is event timing, read only once an end event has passed (``query`` does not
    block); on the CPU the wall clock, at once. ``bound(n)`` keeps the host at most ``n`` steps ahead of the GPU:
    scheduling decisions (who joins, deadlines, cancels) then act on the present, and a request's finish time is
    the device's."""

    def __init__(self, device):
        self.cuda = is_cuda(device)
        self.device = torch.device(device)
        self._pending: deque[_Span] = deque()
        self._open: _Span | None = None

    def begin(self, tokens: int) -> None:
        self._open = _Span(tokens, time_mark(self.device), None)

    def end(self) -> None:
        span, self._open = self._open, None
        if span is not None:
            span.end = time_mark(self.device)
            self._pending.append(span)

    def finished(self) -> list[tuple[int, float]]:
        out = []
        while self._pending:
            s = self._pending[0]
            secs = seconds_between(s.start, s.end)
            if secs is None:
                break
            self._pending.popleft()
            out.append((s.tokens, secs))
        return out

    def bound(self, ahead: int = 1) -> None:
        """Block until at most ``ahead`` recorded steps are still running on the device."""
        if self.cuda and len(self._pending) > ahead:
            self._pending[-1 - ahead].end.synchronize()

    def wait_last(self) -> None:
        """Block until the last recorded step has finished on the device (not the copy streams: other requests'
        loads and recordings)."""
        if self.cuda and self._pending:
            self._pending[-1].end.synchronize()

