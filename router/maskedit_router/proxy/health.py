"""Backend health: cheap readiness checks often, and a real request through every stage now and then.

Triton 2.51 does not restart a crashed decoupled Python stub and its health endpoints keep saying ready, so
readiness alone cannot see a backend that accepts requests but never answers; the probe is a real ``edit``
request (an empty mask: every stage runs, the model does not) that must answer within a timeout. A backend that
answered traffic within the probe interval is alive without a probe: a probe queues behind that traffic in the
pre/post-processing stages, and under heavy load it timed out on busy, healthy backends, which were then taken
out of rotation and had their cache entries purged. For the same reason a probe that times out while the backend
answers other requests is a busy backend, not a dead one, and so is a readiness call that times out right after
answers. After the router itself was stopped (``stall``), no backend is judged by the silence the stall made: each
gets a fresh probe interval, in which the answers it sends (the requests that piled up meanwhile) show it alive.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from tritonclient.grpc import service_pb2

from maskedit_common.triton_refusals import as_refusal

from .backend import FINAL, probe_edit_request
from .server import Router
from .stall import StallAwareLoop

log = logging.getLogger("maskedit.router")
READY_TIMEOUT_S = 2.0


def probe(backend, timeout_s: float) -> bool:
    """One probe request on its own stream, ended cleanly: the request side is closed only after the final
    response (or an error), so the probe request is never cut off inside the decoupled ensemble; the call is
    abandoned only on timeout."""
    answered = threading.Event()
    ok = False

    def requests():
        yield probe_edit_request()
        answered.wait(timeout_s + 1)  # half-close once the request has ended (or give up)

    try:
        call = backend.stub.ModelStreamInfer(requests(), timeout=timeout_s)
        for resp in call:  # drains until the backend ends the stream after our half-close
            if resp.error_message:
                # refused because it is busy (its denoise queue is full): alive and serving, just not this probe
                ok = "RESOURCE_EXHAUSTED" in as_refusal(resp.error_message)
                answered.set()
            elif FINAL in resp.infer_response.parameters and resp.infer_response.parameters[FINAL].bool_param:
                ok = True
                answered.set()
    except grpc.RpcError:
        ok = False
    finally:
        answered.set()
    return ok


class HealthChecker(StallAwareLoop):
    def __init__(self, router: Router, interval_s: float = 1.0, probe_every_s: float = 5.0, probe_timeout_s: float = 5.0):
        super().__init__(interval_s, "health")
        self.r, self.interval, self.probe_every, self.probe_timeout = router, interval_s, probe_every_s, probe_timeout_s
        self._last_probe: dict[str, float] = {}
        self._verdict: dict[str, bool] = {}  # the latest probe's (or recent traffic's) answer per backend

    def check(self, backend) -> bool:
        asked = time.monotonic()
        try:
            ready = backend.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=READY_TIMEOUT_S).ready
        except grpc.RpcError as e:
            # a slow answer from a backend that answers requests is a busy host, not a dead backend
            ready = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and \
                time.monotonic() - backend.last_answer < self.probe_every and backend.load.healthy
        if not ready:
            return False
        now = time.monotonic()
        # Out of rotation (unhealthy, or its breaker open): only a real request that succeeds brings it back, so
        # it is probed at every check once it says ready again; recent answers do not count.
        suspect = not backend.load.healthy or getattr(backend, "circuit_open", False)
        if suspect or now - self._last_probe.get(backend.addr, 0) >= self.probe_every:
            self._last_probe[backend.addr] = now
            # Silent for a whole interval: ask it. The verdict holds until the next probe (readiness alone would
            # put a backend that accepts but never answers back in rotation a second later).
            self._verdict[backend.addr] = ((not suspect and now - backend.last_answer < self.probe_every) or
                                           probe(backend, self.probe_timeout) or
                                           (not suspect and backend.last_answer >= asked))  # busy: answering others
        return self._verdict.get(backend.addr, True)

    def resumed(self, stalled_s: float) -> None:
        """The router was stopped for ``stalled_s``: no backend in rotation is probed for the silence that made;
        each gets a fresh probe interval from now."""
        now = time.monotonic()
        for backend in list(self.r.backends.values()):
            if backend.load.healthy and not getattr(backend, "circuit_open", False):
                self._last_probe[backend.addr] = now
                self._verdict[backend.addr] = True
        self.r.metrics.stalled(stalled_s)

    def step(self) -> None:
        self.sweep()

    def sweep(self) -> None:
        """Check every backend once and act on the verdicts."""
        for backend in list(self.r.backends.values()):
            t0 = time.monotonic()
            ok = self.check(backend)
            # A check that took longer than its own timeouts allow: the router was stopped inside it, and the
            # call timed out on the stall's clock, not the backend's. No verdict from it.
            stalled = self.stall.waited(time.monotonic() - t0, READY_TIMEOUT_S + self.probe_timeout)
            if stalled:
                self.resumed(stalled)
                continue
            was_healthy = backend.load.healthy
            if ok != backend.load.healthy:
                log.warning("backend %s is now %s", backend.addr, "healthy" if ok else "UNHEALTHY")
            backend.load.healthy = ok
            if not ok:
                backend.open_circuit()  # out of rotation until a real request succeeds; caches purged
                if was_healthy:  # its requests end now (retried or failed), not when the client gives up
                    self.r.backend_down(backend, "health check failed")
            elif backend.circuit_open:  # ok here means a probe request succeeded (see ``check``)
                log.warning("backend %s served a probe request: back in rotation", backend.addr)
                backend.succeeded()
            self.r.metrics.healthy.labels(backend.addr).set(1 if ok else 0)
