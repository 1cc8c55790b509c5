"""Requests' adapters on their way to the step batch: what the denoise loop asks before admitting a request.

At submit a request whose adapters are all in the device tier has them at once; otherwise its load starts on the
loader's threads (``loader``) and the request waits in the queue, not admitted to step batches, while the others
keep stepping; the loop is woken when the load ends. A load that fails fails only that request (the ``InvalidInput``
naming LORAS). Hooks go on the denoiser at admission, on the loop thread.

Early start (``MASKEDIT_LORA_EARLY_START``, off by default; SwiftDiffusion's): a request is admitted without
waiting and denoises without its adapters until they arrive; they apply from the step boundary after the load ends
(``patch``). Its result differs from the exact path's (measured in docs/lora.md); such a request never reads or
records activations (cache decision ``off``), since its early steps ran without its adapter set."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

from . import delta
from .loader import AdapterLoader
from .runtime import AdapterRuntime, as_ref


class AdapterJobs:
    def __init__(self, runtime: AdapterRuntime, early_start: bool = False, threads: int = 1):
        self.runtime = runtime
        self.early_start = early_start
        self.loader = AdapterLoader(runtime.resolve, threads)

    def start(self, job, wake: Callable[[], None] | None = None) -> None:
        """Give ``job`` its adapters now if the device tier holds them all, else start loading them."""
        refs = job.inputs.loras
        if job.adapters_loaded or job.adapter_load is not None:
            return
        if not refs:
            job.adapters_loaded = True
            return
        refs = [as_ref(r) for r in refs]
        held = [self.runtime.cached(r, count=False) for r in refs]
        if all(a is not None for a in held):  # never a load here: the caller may hold the engine's lock
            for _ in refs:
                self.runtime.stats.count("device", "hit")
            job.adapters, job.adapters_loaded = tuple((a, r.scale) for a, r in zip(held, refs)), True
            return
        f: Future = self.loader.submit(refs)
        job.adapter_load = f
        if wake is not None:
            f.add_done_callback(lambda _: wake())

    def pending(self, job) -> bool:
        """``job`` waits for its adapters before it may be admitted."""
        f = job.adapter_load
        return not self.early_start and not job.adapters_loaded and f is not None and not f.done()

    @staticmethod
    def failure(job) -> BaseException | None:
        f = job.adapter_load
        return f.exception() if f is not None and f.done() and not job.adapters_loaded else None

    def admit(self, job) -> None:
        """At admission, on the loop thread: the job's adapters (loaded, or loaded here when nobody started the
        load: direct callers of ``ModelRunner.prepare``) with their hooks on the denoiser. Under early start a load
        still in progress leaves the job without adapters for now. Raises a failed load's error."""
        if not job.adapters_loaded:
            f = job.adapter_load
            if f is None:
                job.adapters, job.adapters_loaded = self.runtime.resolve(job.inputs.loras or ()), True
            elif f.done() or not self.early_start:
                job.adapters, job.adapters_loaded = f.result(), True
            else:
                job.adapters = ()
                return
        if job.adapters_from_step is None:
            job.adapters_from_step = job.step_index
        for adapter, _ in job.adapters:
            delta.attach(self.runtime.denoiser, adapter)

    def patch(self, jobs) -> list[tuple[object, BaseException]]:
        """Early start: admitted jobs whose load has ended get their adapters from this step on; returns the jobs
        whose load failed, with the error, for the loop to end."""
        failed = []
        for job in jobs:
            f = job.adapter_load
            if job.adapters_loaded or f is None or not f.done():
                continue
            if f.exception() is not None:
                failed.append((job, f.exception()))
                continue
            self.admit(job)
        return failed
