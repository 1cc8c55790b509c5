"""Mask-aware load-balancing router: a gRPC sidecar that speaks Triton's own protocol (KServe v2
``GRPCInferenceService``) in front of several Triton instances and routes each edit to the instance with the
lowest predicted latency.

Rooms, each importing only those below it (``.importlinter``; docs/architecture.md):

- ``__main__`` (the router process), ``probe`` (a pod's readiness probe): the entry points;
- ``gateway``: the endpoint picker for a Gateway API gateway; ``frontends``: the HTTP ports (KServe, OpenAI);
- ``proxy``: Triton's gRPC protocol in front of the backends, their health and admission;
- ``placement``: where an edit goes (features, books, estimator, policies); ``access``: keys, TLS, tenants, limits;
- ``metrics``: the router's Prometheus metrics.
"""
