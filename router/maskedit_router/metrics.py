"""Prometheus metrics of the router (prometheus-client). Served on the router's HTTP port
(``frontends.http_port``) beside its JSON health view."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("maskedit_router_requests_total", "requests routed", ["backend", "policy"], registry=r)
        self.latency = Histogram("maskedit_router_latency_seconds", "end-to-end latency through the router",
                                 ["backend", "policy"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.decision_s = Histogram("maskedit_router_decision_seconds", "time to choose a backend", ["policy"],
                                    registry=r, buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1))
        self.features_s = Histogram("maskedit_router_features_seconds", "time to read a gRPC request's routing "
                                    "features (template key, mask ratio on the token grid, steps): before the decision",
                                    registry=r, buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1))
        self.error = Histogram("maskedit_router_prediction_error_ratio", "|observed - predicted| / observed",
                               registry=r, buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5))
        self.retries = Counter("maskedit_router_retries_total", "requests retried on another backend, by the "
                               "backend they left (none: no backend was up) and why: failed (it failed or was found "
                               "down before the request streamed anything), refused (its queue was full), waited (left "
                               "waiting in front of its admission check while it refused)",
                               ["backend", "why"], registry=r)
        self.model_scale = Gauge("maskedit_router_model_scale", "observed / profile-predicted latency (online fit)",
                                 registry=r)
        self.model_stale = Gauge("maskedit_router_model_stale", "1 while the cost model's recent error is too large "
                                 "and routing falls back to least masked tokens", registry=r)
        self.healthy = Gauge("maskedit_router_backend_healthy", "1 if the backend is in rotation", ["backend"],
                             registry=r)
        self.refusals = Counter("maskedit_router_refused_total", "requests the router refused itself "
                                "(RESOURCE_EXHAUSTED), by reason: admission, inflight_backend, inflight_total, "
                                "streams_total, streams_connection (and picker_ ones), http_busy",
                                ["reason"], registry=r)
        self.refused_on_behalf = Counter("maskedit_router_admission_timeout_outcome_total", "requests the router "
                                         "refused on a backend's behalf, by what the backend then did with them: "
                                         "dropped (cancelled before pre-processing), refused_there (reached the check "
                                         "first and was refused), admitted (passed the check first)",
                                         ["backend", "where"],
                                         registry=r)
        self.streams_open = Gauge("maskedit_router_streams_open", "open client streams, by port (router, picker)",
                                  ["port"], registry=r)
        self.idle = Counter("maskedit_router_streams_idle_closed_total", "streams ended for sending nothing with "
                            "nothing in flight for the idle timeout, by port (router, picker, http)", ["port"],
                            registry=r)
        self.backend_streams = Counter("maskedit_router_backend_streams_total", "the router's streams to its backends "
                                       "(one per backend, shared by every client stream), by event: opened, "
                                       "idle_closed, broken", ["backend", "event"], registry=r)
        self.stalls = Counter("maskedit_router_stalls_total", "times the router found it had itself been stopped "
                              "(SIGSTOP, a frozen host): its loops discount the gap", registry=r)
        self.stalled_seconds = Counter("maskedit_router_stalled_seconds_total", "seconds the router was stopped",
                                       registry=r)
        self.client_disconnects = Counter("maskedit_router_client_disconnects_total", "HTTP clients that went away "
                                          "before their answer was written, by port (http: metrics, health and "
                                          "Triton's HTTP/REST; openai)", ["port"], registry=r)
        self.admission_wait = Gauge("maskedit_router_admission_wait_seconds", "predicted wait of a request sent "
                                    "now in front of the backend's admission check", ["backend"], registry=r)
        self.admission_polls = Counter("maskedit_router_admission_polls_total", "statistics calls the admission "
                                       "watcher made, by pace: fast (router edits wait in front of the backend's "
                                       "check, or it is refusing), idle (neither)", ["pace"], registry=r)

        # per tenant: the tenant's name from the key file (never the key); "anonymous" without a key file
        self.tenant_requests = Counter("maskedit_router_tenant_requests_total", "requests by tenant and how they "
                                       "ended: ok, error, refused, cancelled", ["tenant", "outcome"], registry=r)
        self.tenant_refusals = Counter("maskedit_router_tenant_refused_total", "requests refused by tenant and "
                                       "reason: rate, concurrency (the key's limits), fair_queue (waited too long "
                                       "in the router's fair queue), forbidden (role)", ["tenant", "reason"],
                                       registry=r)
        self.tenant_latency = Histogram("maskedit_router_tenant_latency_seconds", "end-to-end latency of a "
                                        "tenant's completed requests", ["tenant"], registry=r,
                                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.tenant_wait = Histogram("maskedit_router_tenant_queue_wait_seconds", "time a tenant's edits waited "
                                     "in the router's fair queue", ["tenant"], registry=r,
                                     buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.auth_failures = Counter("maskedit_router_auth_failures_total", "calls refused for their key, by port "
                                     "and reason: unauthenticated (none or unknown), forbidden (role)",
                                     ["port", "reason"], registry=r)
        self.tls_failures = Counter("maskedit_router_tls_handshake_failures_total", "connections whose TLS "
                                    "handshake failed (a plaintext client, an untrusted certificate, a scanner), by "
                                    "port", ["port"], registry=r)
        self.keyfile_reloads = Counter("maskedit_router_keyfile_reloads_total", "reloads of the API key file by "
                                       "outcome (ok; error: the old keys stay)", ["outcome"], registry=r)

    def tenant_ended(self, tenant: str, outcome: str, latency_s: float | None = None) -> None:
        self.tenant_requests.labels(tenant, outcome).inc()
        if outcome == "ok" and latency_s is not None:
            self.tenant_latency.labels(tenant).observe(latency_s)

    def tenant_refused(self, tenant: str, reason: str) -> None:
        self.tenant_refusals.labels(tenant, reason).inc()
        self.tenant_requests.labels(tenant, "refused").inc()

    def queue_wait(self, tenant, seconds: float, granted: bool) -> None:
        self.tenant_wait.labels(tenant.name).observe(seconds)

    def tls_failed(self, port: str) -> None:
        self.tls_failures.labels(port).inc()

    def auth_failed(self, port: str, reason: str) -> None:
        self.auth_failures.labels(port, reason).inc()

    def keyfile_reload(self, outcome: str) -> None:
        self.keyfile_reloads.labels(outcome).inc()

    def decision(self, policy: str, backend: str, seconds: float) -> None:
        self.decision_s.labels(policy).observe(seconds)
        self.requests.labels(backend, policy).inc()

    def completed(self, backend: str, policy: str, observed_s: float, predicted_s: float) -> None:
        self.latency.labels(backend, policy).observe(observed_s)
        if observed_s > 0:
            self.error.observe(abs(observed_s - predicted_s) / observed_s)

    def model(self, scale: float, stale: bool) -> None:
        self.model_scale.set(scale)
        self.model_stale.set(1 if stale else 0)

    def retried(self, backend: str, why: str = "failed") -> None:
        self.retries.labels(backend, why).inc()

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def streams(self, port: str, n: int) -> None:
        self.streams_open.labels(port).set(n)

    def idle_closed(self, port: str) -> None:
        self.idle.labels(port).inc()

    def backend_stream(self, backend: str, event: str) -> None:
        self.backend_streams.labels(backend, event).inc()

    def refused_late(self, backend: str, where: str) -> None:
        self.refused_on_behalf.labels(backend, where).inc()

    def stalled(self, seconds: float) -> None:
        self.stalls.inc()
        self.stalled_seconds.inc(seconds)

    def client_gone(self, port: str) -> None:
        self.client_disconnects.labels(port).inc()

    def admission_polled(self, pace: str, n: int = 1) -> None:
        self.admission_polls.labels(pace).inc(n)

    def admission(self, backend: str, wait_s: float) -> None:
        self.admission_wait.labels(backend).set(wait_s)
