"""The denoise loop: a background thread that keeps a running batch and advances it one step at a time.

Requests are submitted from Triton's ``execute`` (which returns at once: the model is decoupled) and join the
running batch at the next step boundary, as the scheduler decides; finished requests leave at once. Every
submitted job ends in ``on_done`` or ``on_error``: cancelled jobs at the next step, jobs that cannot meet
their deadline before they start, and everything still queued or running at shutdown.
"""

from __future__ import annotations

import logging
import threading
import time

from . import logs
from .denoise import DenoiseJob, ModelRunner
from .errors import Cancelled, ResourceExhausted, Unavailable
from .scheduler import BatchScheduler

log = logging.getLogger(__name__)


class DenoiseEngine:
    def __init__(self, runner: ModelRunner, max_batch: int = 1, max_queue: int = 64,
                 scheduler: BatchScheduler | None = None, on_queue=None):
        self.runner = runner
        self.scheduler = scheduler or BatchScheduler("continuous", max_batch=max_batch)
        self.max_queue = max_queue
        self.on_queue = on_queue  # on_queue(waiting, max_queue) whenever the queue changes (early admission)
        self._waiting: list[DenoiseJob] = []
        self._inline: list = []  # callables the loop runs between steps (the naive baseline's CPU work)
        self._running: list[DenoiseJob] = []
        self._cv = threading.Condition()
        self._stopping = False
        self.steps_run = 0
        self.overhead_s = 0.0  # batching machinery per step: admission decisions, joining and leaving the batch
        self.prepare_s = 0.0  # per-request set-up when a request joins (tensors to device, scheduler, cache plan)
        self.callback_s = 0.0  # on_done/on_error/on_step callbacks (sending responses; inline work in naive mode)
        self.max_running = 0
        self._thread = threading.Thread(target=self._loop, name="denoise-loop", daemon=True)
        self._thread.start()

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    # -- called from other threads ------------------------------------------------------------------
    def submit(self, job: DenoiseJob) -> None:
        with self._cv:
            if self._stopping:
                raise Unavailable("server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise ResourceExhausted(f"denoise queue is full ({self.max_queue} waiting); retry later")
            if job.tokens is None:
                job.tokens = self.runner.estimate_tokens(job)
            err = self.scheduler.late(job, time.time())
            if err is not None:
                raise err
            self._waiting.append(job)
            self._published()
            self._cv.notify()

    def _published(self) -> None:
        if self.on_queue is not None:
            self.on_queue(len(self._waiting), self.max_queue)

    def call_soon(self, fn) -> None:
        """Run ``fn()`` on the loop thread before the next step (blocking the loop, as inline work would)."""
        with self._cv:
            self._inline.append(fn)
            self._cv.notify()

    def stats(self) -> dict:
        with self._cv:
            n = max(1, self.steps_run)
            return {"waiting": len(self._waiting), "running": len(self._running), "steps_run": self.steps_run,
                    "step_overhead_ms": 1000 * self.overhead_s / n, "prepare_ms_per_step": 1000 * self.prepare_s / n,
                    "callback_ms_per_step": 1000 * self.callback_s / n, "max_running": self.max_running}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let the running batch finish within ``timeout``, fail whatever is left."""
        with self._cv:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), []
            self._cv.notify()
        for job in waiting:
            _fail(job, Unavailable("server is shutting down"))
        self._thread.join(timeout)
        with self._cv:
            running, self._running = list(self._running), []
        for job in running:
            self.runner.release(job, ok=False)
            _fail(job, Unavailable("server shut down before the request finished"))

    # -- the loop -----------------------------------------------------------------------------------
    def _admit(self) -> None:
        chosen, rejected = self.scheduler.admit(self._waiting, self._running)
        gone = set(map(id, chosen)) | {id(j) for j, _ in rejected}
        self._waiting = [j for j in self._waiting if id(j) not in gone]
        self._published()
        for job, err in rejected:
            _fail(job, err)
        for job in chosen:
            t = time.perf_counter()
            try:
                if job.before_admit is not None:
                    job.before_admit(job)  # the naive baseline's inline pre-processing
                self.runner.prepare(job)
                self.prepare_s += time.perf_counter() - t
            except Exception as e:  # bad tensors fail this request only
                log.warning("could not prepare request %s: %s", job.id, e)
                self.runner.release(job, ok=False)
                _fail(job, e)
                continue
            self._running.append(job)
        self.max_running = max(self.max_running, len(self._running))

    def _loop(self) -> None:
        while True:
            t0 = time.perf_counter()
            with self._cv:
                while not self._waiting and not self._running and not self._inline and not self._stopping:
                    self._cv.wait()
                    t0 = time.perf_counter()
                if self._stopping and not self._running:
                    return
                inline, self._inline = self._inline, []
            for fn in inline:
                try:
                    fn()
                except Exception:
                    log.exception("inline work failed")
            t0 = time.perf_counter() if inline else t0  # inline work is not batching overhead
            # Per-request set-up and callbacks inside this iteration are not machinery: subtracted below.
            p0, c0 = self.prepare_s, self.callback_s
            with self._cv:
                if not self._stopping:
                    self._admit()
                batch = list(self._running)
            batch = self._drop_cancelled(batch)
            if not batch:
                continue
            t1, cpu1 = time.perf_counter(), time.thread_time()
            try:
                self.runner.step(batch)
                self.steps_run += 1
            except Exception as e:
                log.exception("denoise step failed for requests %s", [j.id for j in batch])
                self._retire(batch, error=e)
                continue
            t2 = time.perf_counter()
            tokens = sum(j.tokens or 0 for j in batch)
            self.scheduler.model.observe(tokens, t2 - t1)
            if log.isEnabledFor(logging.DEBUG):  # wall vs this thread's CPU: waiting for a core shows as the gap
                logs.event(log, "step", logging.DEBUG, batch=len(batch), tokens=tokens,
                           wall_ms=round(1000 * (t2 - t1), 2), cpu_ms=round(1000 * (time.thread_time() - cpu1), 2),
                           jobs=[j.id for j in batch])
            tc = time.perf_counter()
            for job in batch:
                if job.on_step is not None and not job.done:
                    job.on_step(job)
            self.callback_s += time.perf_counter() - tc
            self._retire([j for j in batch if j.done])
            self.overhead_s += (t1 - t0) + (time.perf_counter() - t2) - (self.prepare_s - p0) - \
                (self.callback_s - c0)

    def _drop_cancelled(self, batch: list[DenoiseJob]) -> list[DenoiseJob]:
        cancelled = [j for j in batch if j.is_cancelled()]
        if cancelled:
            self._retire(cancelled, error=Cancelled("request was cancelled by the client"))
        return [j for j in batch if j not in cancelled]

    def _retire(self, jobs: list[DenoiseJob], error: BaseException | None = None) -> None:
        if not jobs:
            return
        with self._cv:
            self._running = [j for j in self._running if j not in jobs]
        for job in jobs:
            job.finished_at = time.perf_counter()
            try:
                self.runner.release(job, ok=error is None)
            except Exception:
                log.exception("releasing request %s failed", job.id)
            t = time.perf_counter()
            if error is not None:
                _fail(job, error)
            else:
                try:
                    job.on_done(job)
                except Exception:
                    log.exception("on_done failed for request %s", job.id)
            self.callback_s += time.perf_counter() - t


def _fail(job: DenoiseJob, error: BaseException) -> None:
    try:
        job.on_error(job, error)
    except Exception:
        log.exception("on_error failed for request %s", job.id)
