from concurrent import futures

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc


@pytest.fixture
def serve():
    """``serve(servicer)``: a gRPC server on a free port of 127.0.0.1 serving ``servicer`` as Triton's
    ``GRPCInferenceService`` (a backend stand-in); returns its address. Every server is stopped after the test."""
    servers = []

    def start(servicer) -> str:
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(0)
