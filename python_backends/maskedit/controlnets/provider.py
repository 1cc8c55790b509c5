"""Where a step's ControlNet residuals come from, behind one interface the family's step calls
(``MASKEDIT_CONTROLNET_PLACEMENT``): ``InProcessProvider`` runs the ControlNets in the denoiser's process and device;
``TritonProvider`` sends each request's controls to the ``controlnet`` Triton model through BLS (its own instance
group: other GPUs or instances) and returns at once, so every request of the step is in flight together and the
caller can do work that does not need the residuals before it asks for them (``Pending.result``).

A failed or timed-out call fails only the requests whose controls it carried (``ControlNetFailed`` naming
CONTROLS, with ``failures``); the engine retires those and runs the rest of the step without them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import EditError
from .wire import pack_request, unpack_residuals

PROVIDERS = ("inprocess", "triton")
FIELD = "CONTROLS"


class ControlNetFailed(EditError):
    """The ``controlnet`` model failed (or timed out) for a job's controls; the others in the step go on. INTERNAL,
    not UNAVAILABLE: clients retry UNAVAILABLE, and a ControlNet that cannot load fails every time.
    ``failures``: (job, its error) for every job of the step whose call failed (the engine retires those)."""

    def __init__(self, message: str, failures: list | None = None):
        super().__init__(message, FIELD)
        self.failures = failures if failures is not None else []


class Stats:
    """Totals the denoise model's metrics read (deltas): steps with controls, their wait, BLS calls, failures."""

    def __init__(self):
        self.lock = threading.Lock()
        self.steps = 0
        self.step_s = 0.0  # wall time from the first call's start to the last result, per step
        self.calls = 0
        self.bls_s = 0.0  # BLS round trips (the ``exec`` call, not packing)
        self.failures = 0
        self.model_s = 0.0  # the controlnet model's own time in those calls (``COMPUTE_S``)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict:
        with self.lock:
            return {k: getattr(self, k) for k in ("steps", "step_s", "calls", "bls_s", "failures", "model_s")}


class Pending:
    """One request's residuals at one step, computed or on their way."""

    def __init__(self, job, value=None, seconds: float = 0.0):
        self.job, self._value, self.seconds, self.bls_s, self.model_s = job, value, seconds, 0.0, 0.0

    def result(self) -> list:
        return self._value


class InProcessProvider:
    placement = "inprocess"

    def __init__(self, family):
        self.family = family
        self.stats = Stats()

    def start(self, job, active: list, inputs: dict) -> Pending:
        """``active``: (ActiveControl, scale at this step) per control acting at this step (scale > 0)."""
        t0, total = time.perf_counter(), None
        for control, scale in active:
            res = self.family.control_residuals(control, inputs, scale)
            total = res if total is None else [a + b for a, b in zip(total, res)]  # MultiControlNetModel's sum
        return Pending(job, total, time.perf_counter() - t0)


class _Remote(Pending):
    def __init__(self, job, future, names, provider):
        super().__init__(job)
        self._future, self._names, self._p = future, names, provider
        self._sent = time.perf_counter()

    def result(self) -> list:
        p = self._p
        try:
            # The deadline counts from the call's start. BLS's own ``timeout`` does not end a call the controlnet
            # model is already executing (tritonserver 2.51: a 1 ms timeout let far longer calls return their
            # answers), so this is what enforces it.
            wait = max(0.0, p.timeout_s - (time.perf_counter() - self._sent))
            out, self.seconds, self.bls_s, self.model_s = self._future.result(timeout=wait)
            return unpack_residuals(out, p.device, p.dtype)
        except FutureTimeout:
            reason = f"timed out after {p.timeout_s:g} s (MASKEDIT_CONTROLNET_TIMEOUT_S)"
        except Exception as e:  # the model's error, a lost server, a bad answer: this request only
            reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        p.stats.add(failures=1)
        e = ControlNetFailed(f"the controlnet model failed for ControlNet {', '.join(map(repr, self._names))}: "
                             f"{reason}")
        e.failures.append((self.job, e))
        raise e


class TritonProvider:
    """BLS calls to the ``controlnet`` model, one per request with active controls per step, run on a small thread
    pool (Triton's ``exec`` blocks; the pool keeps a step's calls in flight together). ``transport``: a function
    from ``wire.pack_request``'s arrays to the response arrays (``maskedit.triton.controlnet_bls.transport``)."""

    placement = "triton"

    def __init__(self, transport, device, dtype, timeout_s: float = 30.0, workers: int = 4):
        self.transport, self.device, self.dtype, self.timeout_s = transport, device, dtype, timeout_s
        self.stats = Stats()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="controlnet-bls")

    def _call(self, arrays):
        t0 = time.perf_counter()
        out = self.transport(arrays)
        t1 = time.perf_counter()
        model_s = float(out["COMPUTE_S"].reshape(-1)[0]) if out.get("COMPUTE_S") is not None else 0.0
        self.stats.add(calls=1, bls_s=t1 - t0, model_s=model_s)
        return out, t1 - t0, t1 - t0, model_s

    def start(self, job, active: list, inputs: dict) -> Pending:
        arrays = pack_request([(c.spec.name, s, c.spec.mode, c.image) for c, s in active], inputs)
        return _Remote(job, self._pool.submit(self._call, arrays), [c.spec.name for c, _ in active], self)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_provider(runner, transport=None):
    """The runner's provider for ``settings.controlnet_placement``. ``transport`` (``triton`` placement): the BLS
    call, handed in by the Triton shim (``maskedit.triton.controlnet_bls``), so this layer needs no Triton import."""
    s = runner.settings
    if s.controlnet_placement == "triton":
        if transport is None:
            raise RuntimeError("MASKEDIT_CONTROLNET_PLACEMENT=triton needs the Triton server's controlnet model (BLS); "
                               "this process has no transport to it")
        return TritonProvider(transport, runner.device, runner.dtype, s.controlnet_timeout_s)
    return InProcessProvider(runner.family)
