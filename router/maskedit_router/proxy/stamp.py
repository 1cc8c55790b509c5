"""What the router forwards is stamped with when the router received it (``maskedit_common.sent_stamp``): a
backend's bound counts from there, the router's fair queue and retries included, on the router's clock. Whatever
the client stamped is overwritten (its clock is not the router's to vouch for). A stream request retried after a
backoff is sent with what is left of its DEADLINE_MS, so it is stamped again then."""

from __future__ import annotations

from maskedit_common.sent_stamp import SENT_AT, SENT_CLOCK, host_clock


def stamp(request, now: float) -> None:
    """Stamp ``request`` (a ModelInferRequest the router forwards) as received (or re-sent) at ``now``
    (``time.time()``)."""
    request.parameters[SENT_AT].double_param = now
    request.parameters[SENT_CLOCK].string_param = host_clock()
