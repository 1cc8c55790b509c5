"""The Gateway API Inference Extension endpoint picker: Envoy's external-processing protocol (``picker``), what it
reads from a forwarded body (``picker_body``), the two ext_proc fields the pinned stubs lack (``extproc_wire``) and
the gRPC health protocol it answers (``grpc_health``). It picks through a ``proxy.server.Router`` over the pods."""
