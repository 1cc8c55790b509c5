"""The denoise loop: a background thread that keeps a running batch and advances it one step at a time.

Requests are submitted from Triton's ``execute`` (which returns at once: the model is decoupled) and join the
running batch at the next step boundary, as the scheduler decides; finished requests leave at once. Every
submitted job ends in ``on_done`` or ``on_error``: cancelled jobs at the next step, jobs that cannot meet
their deadline or bound before they start (``maskedit.completion``), admitted ones that can no longer be answered
within their bound before their next step, and everything still queued or running at shutdown.
"""

from __future__ import annotations

import logging
import threading
import time

from . import completion, logs
from .denoise import DenoiseJob, ModelRunner
from .device import StepClock, device_lost, out_of_memory, release_cached_memory
from .errors import Cancelled, ResourceExhausted, Unavailable
from .fair_share import FairShare, loads
from .scheduler import BatchScheduler
from .cache.integrity import corrupt_entry

log = logging.getLogger(__name__)


class DenoiseEngine:
    def __init__(self, runner: ModelRunner, max_batch: int = 1, max_queue: int = 64,
                 scheduler: BatchScheduler | None = None, on_queue=None, fair: FairShare | None = None,
                 on_backlog=None):
        self.runner = runner
        self.scheduler = scheduler or BatchScheduler("continuous", max_batch=max_batch)
        self.max_queue = max_queue
        self.on_queue = on_queue  # on_queue(waiting, max_queue, shares) whenever the queue changes (early admission)
        self.fair = fair or FairShare(enabled=False)  # tenants' order in the queue and who gives way when it is full
        # on_backlog(completion.Backlog) after every step and queue change: pre-processing predicts from it when a
        # new request would be answered (``maskedit.completion``)
        self.on_backlog = on_backlog
        self.tokens_seen = completion.Ema(clamp=float("inf"))  # tokens per step of the requests it admitted
        self._waiting: list[DenoiseJob] = []
        self._running: list[DenoiseJob] = []
        # admitted, being prepared by the loop outside the lock (``_prepare``): in neither list above until then
        self._admitting: list[DenoiseJob] = []
        self._cv = threading.Condition()
        self._stopping = False
        self.steps_run = 0
        self.overhead_s = 0.0  # batching machinery per step: admission decisions, joining and leaving the batch
        self.prepare_s = 0.0  # per-request set-up when a request joins (tensors to device, scheduler, cache plan)
        self.callback_s = 0.0  # on_done/on_error/on_step callbacks (sending responses; inline work in naive mode)
        self.max_running = 0
        # Step times for the scheduler's cost model, true on the device (CUDA events, read without stalling); the
        # host stays at most one step ahead of a GPU, so admission, deadlines and cancels act on the present.
        self.clock = StepClock(runner.device)
        self.broken: Unavailable | None = None  # set when the device failed beyond recovery
        self._thread = threading.Thread(target=self._loop, name="denoise-loop", daemon=True)
        self._thread.start()
        with self._cv:
            self._published()  # a restarted process replaces what its predecessor left on the board

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    # -- called from other threads ------------------------------------------------------------------
    def submit(self, job: DenoiseJob) -> None:
        with self._cv:
            if self.broken is not None:  # a fresh error per caller (one shared instance would pile up tracebacks)
                raise Unavailable(str(self.broken))
            if self._stopping:
                raise Unavailable("server is shutting down")
            displaced = None
            if len(self._waiting) >= self.max_queue:
                displaced = self.fair.make_room(self._waiting, job)  # or raises: refused
            if job.tokens is None:
                job.tokens = self.runner.estimate_tokens(job)
            now = time.time()
            err = self.scheduler.late(job, now) or self._bound_refusal(job, displaced, now)
            if err is not None:
                raise err
            if displaced is not None:
                self._waiting.remove(displaced)
            self.fair.tag(job)
            # Its adapters: from the device tier now, or loading in the background while it waits (the loop is
            # woken when the load ends); a bad adapter fails it when the loop collects the load.
            self.runner.start_adapters(job, wake=self._wake)
            self._waiting.append(job)
            self._published()
            self._cv.notify()
        if displaced is not None:
            _fail(displaced, ResourceExhausted(
                f"denoise queue is full ({self.max_queue} waiting) and tenant '{displaced.tenant}' holds more than "
                f"its fair share of it: this request gave its place to another tenant's; retry later"))

    def _bound_refusal(self, job: DenoiseJob, displaced, now: float):
        """Its refusal if, behind the batch and the queue as they are, it would be answered past its bound or make
        one of them late (``maskedit.completion``; its tokens are exact here). Called holding the lock."""
        by = job.inputs.answer_by
        if by is None or not self.scheduler.reject_late:
            return None
        bound_s = job.inputs.bound_s or 0.0
        bound = completion.Bound(bound_s, max(0.0, now - (by - bound_s)), job.inputs.bound_source or
                                 completion.SERVER_BOUND)
        work = lambda j: self.scheduler.work(j, now)  # noqa: E731
        return completion.refusal(self.scheduler.loop(), [work(j) for j in self._running + self._admitting],
                                  [work(j) for j in self._waiting if j is not displaced], work(job), bound,
                                  where="refused before denoising")

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _published(self) -> None:
        if self.on_queue is not None:
            self.on_queue(len(self._waiting), self.max_queue, loads(self._waiting) if self.fair.enabled else None)
        self._publish_backlog()

    def _publish_backlog(self) -> None:
        """The batch and the queue, each request's steps left, tokens and answer-by, and the step-time model as
        measured, for pre-processing's time check. Called holding the lock."""
        if self.on_backlog is None:
            return
        row = lambda j: (j.steps - j.step_index, j.tokens or 0, j.inputs.answer_by or float("inf"))  # noqa: E731
        m = self.scheduler.model
        self.on_backlog(completion.Backlog([row(j) for j in self._running + self._admitting],
                                           [row(j) for j in self._waiting], m.fixed_s, m.per_token_s,
                                           self.tokens_seen.get()))

    def stats(self) -> dict:
        with self._cv:
            n = max(1, self.steps_run)
            return {"waiting": len(self._waiting), "running": len(self._running) + len(self._admitting),
                    "steps_run": self.steps_run,
                    "loading_adapters": sum(1 for j in self._waiting if self.runner.adapters_pending(j)),
                    "paused": sum(1 for j in self._running if j.idle_steps > 0),
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
            admitting, self._admitting = list(self._admitting), []  # the loop releases any it prepares
        for job in running:
            self.runner.release(job, ok=False)
        for job in running + admitting:
            _fail(job, Unavailable("server shut down before the request finished"))

    # -- the loop -----------------------------------------------------------------------------------
    def _idle(self) -> bool:
        """Nothing to do: the loop sleeps until a submit, an adapter load ending (or shutdown) notifies it. Called
        holding the lock."""
        return not self._running and not self._stopping and \
            all(self.runner.adapters_pending(j) for j in self._waiting)

    def _between_steps(self) -> bool:
        """Work a subclass runs on the loop thread before each step (a benchmark baseline); True if it ran any."""
        return False

    def _schedule(self, gave_up: set[int] = frozenset()) -> tuple[list[DenoiseJob], list[DenoiseJob]]:
        """Apply the scheduler's decision for this step: reject, and admit (into ``_admitting``, for ``_prepare``).
        Returns (the jobs to advance, the admitted ones). Admitted jobs it leaves out are paused
        (``priority`` preempts at step boundaries); they keep their state. ``gave_up``: ids of waiting requests whose
        clients cancelled while their adapters loaded. Called holding the lock."""
        # Adapters: a failed load fails its request alone; a request still loading waits unseen by the scheduler;
        # under early start, admitted requests whose adapters arrived carry them from this step on.
        bad = [(j, self.runner.adapter_failure(j)) for j in self._waiting]
        bad = [(j, e) for j, e in bad if e is not None] + \
            [(j, Cancelled("request was cancelled by the client")) for j in self._waiting if id(j) in gave_up]
        for job, err in self.runner.patch_adapters(self._running):  # loads that failed after they started
            self._running = [j for j in self._running if j is not job]
            self.runner.release(job, ok=False)
            _fail(job, err)
        for job in self._waiting:  # the cache decision, once per request: its token count is what is scheduled
            if job.decision is None:
                self.runner.decide(job)
        gone = {id(j) for j, _ in bad}
        ready = [j for j in self._waiting if id(j) not in gone and not self.runner.adapters_pending(j)]
        out = self.scheduler.select(ready, self._running)
        gone |= set(map(id, out.admitted)) | {id(j) for j, _ in out.rejected}
        self._waiting = [j for j in self._waiting if id(j) not in gone]
        self._admitting = list(out.admitted)  # before anything that may raise: _fail_all finds them there
        self._published()
        for job, err in out.rejected + bad:
            _fail(job, err)
        for job in out.admitted:
            self.fair.started(job, self._waiting)
            self.tokens_seen.observe(job.tokens or 0)
        for job in self._waiting + out.paused:  # waiting and paused requests age (bounded waiting)
            job.idle_steps += 1
        return list(out.step), list(out.admitted)

    def _prepare(self, batch: list[DenoiseJob], admitted: list[DenoiseJob]) -> list[DenoiseJob]:
        """Prepare the admitted jobs (tensors to the device, adapters and ControlNets in, the cache's admit: a disk
        read can take a while) without holding the lock, so submit() and stats() do not wait for it; each joins the
        running batch when ready. Returns ``batch`` less those that failed, or that shutdown or a loop failure
        ended meanwhile."""
        failed = set()
        for job in batch:  # not paused from here on (stats() may read them while a later one prepares)
            job.idle_steps = 0
        for job in admitted:
            with self._cv:
                if not any(job is j for j in self._admitting):  # shutdown ended it before its turn
                    failed.add(id(job))
                    continue
            t = time.perf_counter()
            try:
                self.runner.prepare(job)
                err = None
            except Exception as e:  # bad tensors fail this request only
                log.warning("could not prepare request %s: %s", job.id, e)
                err = e
            self.prepare_s += time.perf_counter() - t
            with self._cv:
                ours = any(job is j for j in self._admitting)  # else shutdown or _fail_all has ended it
                self._admitting = [j for j in self._admitting if j is not job]
                if ours and err is None:
                    self._running.append(job)
                    continue
                self._publish_backlog()  # it left the board
            failed.add(id(job))
            self._release(job, ok=False)  # released, then answered, as _retire does
            if ours:
                _fail(job, err)
        batch = [j for j in batch if id(j) not in failed]
        self.max_running = max(self.max_running, len(batch))
        return batch

    def _loop(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as e:  # the loop must outlive anything an iteration raises: its requests end instead
                self._fail_all(e)

    def _fail_all(self, e: BaseException) -> None:
        """Something outside a request's own step failed (a device error surfacing at a sync, a callback): end
        every admitted request with an error. An unrecoverable device error also ends the waiting ones and every
        later one, with UNAVAILABLE: the process must be restarted (the supervisor does, or the operator)."""
        fatal = device_lost(e)
        log.exception("denoise loop failed%s", "; the device is unusable, refusing all requests" if fatal else "")
        err = Unavailable(f"the GPU failed ({_describe(e)}); this server must be restarted") if fatal else \
            Unavailable(f"the denoise loop failed ({_describe(e)}); retry")
        with self._cv:
            if fatal:
                self.broken = err
                waiting, self._waiting = list(self._waiting), []
                self._published()
            else:
                waiting = []
            running = list(self._running)
            admitting, self._admitting = list(self._admitting), []  # admitted, not yet running when it raised
        self._retire(running, error=err)
        for job in admitting:
            self._release(job, ok=False)
        for job in waiting + admitting:
            _fail(job, err)

    def _iterate(self) -> bool:
        """One step of the loop; False once it should stop."""
        t0 = time.perf_counter()
        with self._cv:
            while self._idle():
                self._cv.wait()
                t0 = time.perf_counter()
            if self._stopping and not self._running:
                return False
        if self._between_steps():
            t0 = time.perf_counter()  # work run there is not batching overhead
        # Per-request set-up and callbacks inside this iteration are not machinery: subtracted below.
        p0, c0 = self.prepare_s, self.callback_s
        with self._cv:
            pending = [j for j in self._waiting if self.runner.adapters_pending(j)]
        # asked outside the lock, as _drop_cancelled does: a check that stalls must not hold up submit()
        gave_up = {id(j) for j in pending if j.is_cancelled()}  # it may wait long for its adapters: asked while it does
        with self._cv:
            batch, admitted = (list(self._running), []) if self._stopping else self._schedule(gave_up)
        batch = self._prepare(batch, admitted)
        batch = self._drop_overdue(self._drop_cancelled(batch))
        with self._cv:  # a shutdown while the checks ran (outside the lock) has failed what it found running
            batch = [j for j in batch if j in self._running]
        if not batch:
            return True
        tokens = sum(j.tokens or 0 for j in batch)
        self.clock.bound(1)
        t1, cpu1 = time.perf_counter(), time.thread_time()
        self.clock.begin(tokens)
        batch = self._step(batch)
        self.clock.end()
        self.steps_run += 1
        if not batch:
            return True
        t2, cpu2 = time.perf_counter(), time.thread_time()
        for step_tokens, seconds in self.clock.finished():
            self.scheduler.model.observe(step_tokens, seconds)
        for job in batch:  # wall vs this thread's CPU: waiting for a core shows as the gap
            job.steps_wall_s += t2 - t1
            job.steps_cpu_s += cpu2 - cpu1
        if log.isEnabledFor(logging.DEBUG):
            logs.event(log, "step", logging.DEBUG, batch=len(batch), tokens=tokens,
                       wall_ms=round(1000 * (t2 - t1), 2), cpu_ms=round(1000 * (cpu2 - cpu1), 2),
                       jobs=[j.id for j in batch])
        tc = time.perf_counter()
        for job in batch:
            if job.on_step is not None and not job.done:
                try:
                    job.on_step(job)
                except Exception as e:  # its progress could not be sent: that request ends, the others go on
                    log.exception("progress callback failed for request %s", job.id)
                    self._retire([job], error=e)
        self.callback_s += time.perf_counter() - tc
        self._retire([j for j in batch if j.done and j in self._running])
        with self._cv:
            self._publish_backlog()  # steps left moved on, finished requests left
        self.overhead_s += (t1 - t0) + (time.perf_counter() - t2) - (self.prepare_s - p0) - \
            (self.callback_s - c0)
        return True

    def _step(self, batch: list[DenoiseJob]) -> list[DenoiseJob]:
        """Advance ``batch`` one step; returns the jobs that advanced. If the shared step fails (a CUDA
        out-of-memory error, a device error, a bad request), every job it did not advance retries alone, so only
        the request at fault fails and the others go on."""
        before = {id(j): j.step_index for j in batch}
        try:
            self.runner.step(batch)
            return batch
        except Exception as e:
            if device_lost(e):  # nothing on this device can run any more: no retries
                raise
            first = e
        log.warning("denoise step failed for requests %s (%s); retrying them one by one",
                    [j.id for j in batch], _describe(first))
        release_cached_memory(self.runner.device)
        ok = [j for j in batch if j.step_index > before[id(j)]]  # advanced before the failure
        failed = []
        at_fault = getattr(first, "failures", None) or []  # (job, error): e.g. its ControlNet call failed; not
        for job, error in at_fault:  # retried (a timeout would be waited for twice), the others retry
            if any(job is j for j in batch) and job.step_index == before[id(job)]:
                self._retire([job], error=error)
        batch = [j for j in batch if not any(j is k for k, _ in at_fault)]
        for job in (j for j in batch if j.step_index == before[id(j)]):
            try:
                self.runner.step([job])
                ok.append(job)
            except Exception as e:
                if device_lost(e):
                    raise
                if corrupt_entry(e) is not None and self._recompute(job, corrupt_entry(e)):
                    continue  # back at its first step without the bad entry: it stays in the batch
                log.exception("denoise step failed for request %s", job.id)
                release_cached_memory(self.runner.device)
                failed.append((job, e))
        for job, e in failed:
            self._retire([job], error=_step_error(e))
        return [j for j in batch if any(j is k for k in ok)]

    def _recompute(self, job: DenoiseJob, error: BaseException) -> bool:
        """``job``'s cached rows failed verification: start it again without them. False if that failed too."""
        try:
            self.runner.recompute(job, error)
            return True
        except Exception:
            log.exception("could not restart request %s without its corrupt activation entry", job.id)
            return False

    def _drop_cancelled(self, batch: list[DenoiseJob]) -> list[DenoiseJob]:
        """End every cancelled admitted request (paused ones too) and return the rest of ``batch``."""
        with self._cv:
            running = list(self._running)
        # asked outside the lock: a check that stalls (a cancel marker on a slow disk) must not hold up submit()
        cancelled = [j for j in running if j.is_cancelled()]
        if cancelled:
            self._retire(cancelled, error=Cancelled("request was cancelled by the client"))
        return [j for j in batch if j not in cancelled]

    def _drop_overdue(self, batch: list[DenoiseJob]) -> list[DenoiseJob]:
        """End every admitted request that can no longer be answered within its bound (``BatchScheduler.overdue``:
        the next step would end past it) and return the rest of ``batch``. Those that finish at the next step are
        decoded one at a time, in the batch's order: the k-th of them waits for k decodings."""
        now = time.time()
        step_s, decode_s = self.scheduler.model.predict(sum(j.tokens or 0 for j in batch)), self.scheduler.decode_s()
        last = [j for j in batch if j.steps - j.step_index <= 1]
        decodes = {id(j): k + 1 for k, j in enumerate(last)}
        with self._cv:
            over = [(j, e) for j in self._running if (e := self.scheduler.overdue(
                j, now, step_s + decode_s * decodes.get(id(j), 1))) is not None]
        for job, err in over:
            self._retire([job], error=err)
        return [j for j in batch if not any(j is k for k, _ in over)]

    def _release(self, job: DenoiseJob, ok: bool) -> None:
        """The runner's release of ``job``; a failure is logged, never raised: the job must still be answered."""
        try:
            self.runner.release(job, ok=ok)
        except Exception:
            log.exception("releasing request %s failed", job.id)

    def _retire(self, jobs: list[DenoiseJob], error: BaseException | None = None) -> None:
        with self._cv:  # only those still running: shutdown may have failed a job the loop was deciding about
            jobs = [j for j in jobs if j in self._running]
            self._running = [j for j in self._running if j not in jobs]
        if not jobs:
            return
        if error is None:
            self.clock.wait_last()  # a GPU has finished their last step: finish times are the device's
        for job in jobs:
            job.finished_at = time.perf_counter()
            self._release(job, ok=error is None)
            t = time.perf_counter()
            if error is not None:
                _fail(job, error)
            else:
                try:
                    job.on_done(job)
                except Exception:
                    log.exception("on_done failed for request %s", job.id)
            self.callback_s += time.perf_counter() - t


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _step_error(e: BaseException) -> BaseException:
    """What the client is told when its request's step failed."""
    if out_of_memory(e):
        return ResourceExhausted("the GPU ran out of memory denoising this request; retry later or with a smaller "
                                 "image")
    return e


def _fail(job: DenoiseJob, error: BaseException) -> None:
    try:
        job.on_error(job, error)
    except Exception:
        log.exception("on_error failed for request %s", job.id)
