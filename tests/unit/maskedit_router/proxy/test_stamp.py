"""The router stamps what it forwards with when it received it, on its own clock (``maskedit_common.sent_stamp``),
whatever the client stamped: the backends' bounds count from the service's front door."""

from tritonclient.grpc import service_pb2

from maskedit_common.sent_stamp import SENT_AT, SENT_CLOCK, host_clock
from maskedit_router.proxy.stamp import stamp


def test_the_router_overwrites_the_clients_stamp_with_its_own():
    req = service_pb2.ModelInferRequest()
    req.parameters[SENT_AT].double_param = 1.0  # the client's claim, on the client's clock
    req.parameters[SENT_CLOCK].string_param = "a-client"
    stamp(req, 1234.5)
    assert req.parameters[SENT_AT].double_param == 1234.5
    assert req.parameters[SENT_CLOCK].string_param == host_clock()
