"""Drive a target with a list of requests, open loop: each request is sent at its arrival time whatever
the state of earlier ones. Targets a Triton endpoint or the router through the project's client."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from maskedit import samples
from maskedit_client import encode_image

from .records import Record
from .workload import Request


class Assets:
    """Encoded templates and masks, made before the run so the sender never lags its schedule."""

    def __init__(self, size: int = 256):
        self.size = size
        self._templates: dict[int, bytes] = {}

    def template(self, i: int) -> bytes:
        if i not in self._templates:
            self._templates[i] = encode_image(samples.template(self.size, self.size, seed=1000 + i))
        return self._templates[i]

    def mask(self, r: Request) -> bytes:
        if r.mask_file:
            return Path(r.mask_file).read_bytes()
        return encode_image(samples.mask(self.size, self.size, r.mask_ratio, r.mask_shape, seed=r.seed))


LOST = "LOST"  # neither a result nor an error arrived before the load generator stopped waiting


def run(client, requests: list[Request], assets: Assets, timeout_s: float = 120.0, progress: bool = True,
        register_templates: bool = False, on_start=None, images: dict | None = None,
        clients: dict | None = None) -> tuple[list[Record], float]:
    """Send every request at its time through ``client`` (an ``EditClient``); returns records and wall time.

    Waits at most ``timeout_s`` after the last request was sent; a request with no answer by then is recorded
    as ``LOST``, and anything that arrives for it later (the client's own cancel when it closes) is ignored, so
    a record says what the service did, never what the load generator did on its way out. ``images``: filled with
    each answered request's PNG by its index (to check results afterwards). ``clients``: tenant -> ``EditClient``
    (each with its tenant's API key): a request with a ``tenant`` goes through its tenant's client."""
    if register_templates:
        for tid in sorted({r.template for r in requests}):
            steps = {r.steps for r in requests if r.template == tid}
            for st in steps:
                client.register_template(assets.template(tid), steps=st)
    payloads = [(assets.template(r.template), assets.mask(r)) for r in requests]
    records = [Record(index=i, template=r.template, mask_ratio=r.mask_ratio, arrival_s=r.t, submit_s=0.0,
                      deadline_ms=r.deadline_ms) for i, r in enumerate(requests)]
    done = threading.Semaphore(0)
    closing = threading.Lock()
    closed = False
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    t0 = time.perf_counter()
    if on_start is not None:  # records' times count from t0 (perf_counter): a caller timing events aligns on it
        on_start(t0)

    def finish(rec: Record, fut) -> None:
        with closing:
            if closed:
                return
            rec.done_s = time.perf_counter() - t0
        try:
            res = fut.result()
            info = res.info
            rec.queue_s, rec.denoise_s, rec.cache_hit = info.get("queue_s"), info.get("denoise_s"), info.get("cache_hit")
            keep = ("instance", "cache_source", "full_steps", "computed_tokens", "healed_tokens", "cache_corrupt",
                    "steps_wall_s", "steps_cpu_s")
            rec.extra.update({k: info[k] for k in keep if info.get(k) is not None})
            if images is not None:
                images[rec.index] = res.png
        except Exception as e:
            rec.error, rec.error_code = str(e)[:300], getattr(e, "code", type(e).__name__)
        bar.update(1)
        done.release()

    for rec, r, (tpl, mask) in zip(records, requests, payloads):
        delay = r.t - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        rec.submit_s = time.perf_counter() - t0

        def on_progress(step, steps, rec=rec):
            if rec.first_progress_s is None:
                rec.first_progress_s = time.perf_counter() - t0

        try:
            via = clients[r.tenant] if clients and r.tenant in clients else client
            lora_kw = {"loras": [tuple(x) for x in r.loras]} if r.loras else {}  # (clients without adapters too)
            fut = via.submit(tpl, mask, r.prompt, seed=r.seed, steps=r.steps, deadline_ms=r.deadline_ms,
                             on_progress=on_progress, **lora_kw)
        except Exception as e:
            rec.error, rec.error_code, rec.done_s = str(e)[:300], getattr(e, "code", "SUBMIT"), rec.submit_s
            bar.update(1)
            done.release()
            continue
        fut.add_done_callback(lambda f, rec=rec: finish(rec, f))
    deadline = time.perf_counter() + timeout_s
    for _ in requests:
        if not done.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            break
    bar.close()
    with closing:
        closed = True
        for rec in records:
            if rec.done_s is None:
                rec.error, rec.error_code = f"no result and no error within {timeout_s:g} s of the last send", LOST
    return records, time.perf_counter() - t0


def latency_percentiles(records: list[Record]) -> dict:
    lat = [r.latency_s for r in records if r.latency_s is not None]
    return {p: float(np.percentile(lat, p)) for p in (50, 95, 99)} if lat else {}
