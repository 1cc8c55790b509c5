"""Mask-aware load-balancing router: a gRPC sidecar that speaks Triton's own protocol (KServe v2
``GRPCInferenceService``) in front of several Triton instances and routes each edit to the instance with the
lowest predicted latency."""
