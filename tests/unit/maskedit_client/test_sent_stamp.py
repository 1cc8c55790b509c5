"""The client stamps each request as it sends it (``maskedit_common.sent_stamp``: the server's bound counts from
there), with the backend's names, and again when it sends it again."""

import time

from maskedit_client import client as client_mod
from maskedit_common import sent_stamp as wire


def test_the_names_and_the_clock_are_the_backends():
    assert (client_mod.SENT_AT, client_mod.SENT_CLOCK) == (wire.SENT_AT, wire.SENT_CLOCK)
    assert client_mod._host_clock() == wire.host_clock()


def test_each_send_is_stamped_as_it_goes(monkeypatch):
    c = client_mod.EditClient("127.0.0.1:1")
    sent = []
    c._reached = True  # as after a first connection: sent at once
    monkeypatch.setattr(c, "_ensure_stream", lambda: None)
    monkeypatch.setattr(c._client, "async_stream_infer", lambda *a, **k: sent.append((time.time(), k["parameters"])))
    before = time.time()
    fut = c.submit_inputs([])
    time.sleep(0.01)
    c._retrying[fut.request_id] = c._pending.pop(fut.request_id)  # as a retry after a backoff
    c._resend(fut.request_id)
    (t1, p1), (t2, p2) = sent
    assert before <= p1[wire.SENT_AT] <= t1 < p2[wire.SENT_AT] <= t2  # each send its own time
    assert p1[wire.SENT_CLOCK] == p2[wire.SENT_CLOCK] == wire.host_clock()
    c._pending.clear()  # nothing to cancel on a server that is not there
    c.close()
