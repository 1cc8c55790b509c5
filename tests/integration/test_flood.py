"""A flood straight at one server (no router in front): Triton's queue policy on ``preprocess`` refuses what cannot
wait there at once, before any pre-processing, with the request's own id (a client with every request on one stream
gets each answer), and every request ends in a result or a RESOURCE_EXHAUSTED refusal, none lost. The server keeps
serving afterwards. On the code before the policy no refusal came from that queue: the whole flood waited in front
of pre-processing (``make overload``'s flood measures it at 160 requests on a loaded host)."""

import time

from maskedit import samples
from maskedit_client import EditClient, EditError


def test_a_flood_at_one_server_is_answered_or_refused_at_once_none_lost(server, template_img, box_mask):
    n = 48
    masks = [samples.mask(256, 256, 0.3, "box", seed=i) for i in range(n)]
    with EditClient(server.grpc_url, retry=False, timeout_s=300) as c:
        futs, took = [], {}
        for i, m in enumerate(masks):
            t = time.monotonic()
            f = c.submit(template_img, m, "a red hat", seed=i, steps=2)
            f.add_done_callback(lambda _, i=i, t=t: took.__setitem__(i, time.monotonic() - t))
            futs.append(f)
        outcomes = []
        for i, f in enumerate(futs):
            try:
                f.result(timeout=300)
                outcomes.append(("ok", None, took.get(i)))
            except EditError as e:
                outcomes.append((e.code, str(e), took.get(i)))
            except TimeoutError:  # no answer: lost
                outcomes.append(("LOST", None, None))
    codes = sorted({code for code, _, _ in outcomes})
    assert set(codes) <= {"ok", "RESOURCE_EXHAUSTED"}, outcomes
    at_queue = [s for code, m, s in outcomes if code == "RESOURCE_EXHAUSTED" and "Exceeds maximum queue size" in m]
    assert at_queue, f"nothing was refused in front of pre-processing: {codes}"
    assert max(at_queue) < 5.0, at_queue  # at once, however long the work in front of it
    assert sum(code == "ok" for code, _, _ in outcomes) >= 1
    # the server still serves
    with EditClient(server.grpc_url, timeout_s=120) as c:
        assert c.edit(template_img, box_mask, "a hat", seed=1, steps=2).image.size == (256, 256)
