"""A flood straight at one server (no router in front): every request is answered (a result) or refused within its
bound of its arrival, none lost, and the server keeps serving afterwards.

Two bounds meet a flood. Triton's queue policy on ``preprocess`` refuses what cannot wait there at once, before any
pre-processing, with the request's own id (a client with every request on one stream gets each answer). And the time
bound (``maskedit.completion``): a request predicted to be answered after its bound — the work ahead at the step time
measured now — is refused before any work, one that waited too long is refused when it reaches the front of the
denoise queue, and one the host turned too slow for ends at its bound. The bound here is the requests' DEADLINE_MS
(the server's MASKEDIT_LATENCY_BOUND_S is the same check, tightened by it; the session's server has a long one):
several times what one edit takes on this host just before the flood, so that it keeps its meaning on a loaded CI
host — some of the flood fits in it, all of it does not. Before the time bound, the requests that got past Triton's
queue were all served, one batch after another: on this host ~20 edits' time, far past it (``make overload``'s flood
measures it at 160 requests).

The bound counts from when the client sent each request (its stamp, ``maskedit.arrival``), however long it then
waited in Triton's queue in front of pre-processing: the server's own EDIT_INFO must say so. Before the stamp the
server inferred the arrival from pre-processing's executions and read Triton's 0.5 s pauses between them as an empty
queue: on a quiet host requests were served up to 6.7 s after they were sent with a 1.5 s bound."""

import time

import pytest

from maskedit import samples
from maskedit_client import EditClient, EditError

STEPS = 20


def test_a_flood_at_one_server_is_answered_or_refused_within_its_bound_none_lost(server, template_img, box_mask):
    # one client, connected by the warm-up: each flood request goes out (and is stamped) before submit returns
    c = EditClient(server.grpc_url, retry=False, timeout_s=300)
    like_flood = samples.mask(256, 256, 0.3, "box", seed=100)
    # warm until the server's own prediction of an edit is within 2x of what it took: its step-time model starts
    # from the first edit's cold steps (seconds each; one run's second edit took 2 s, predicted 25 s), and a flood
    # judged by that model is refused whole in milliseconds, which tests none of what follows
    warm = []
    for seed in range(6):
        r = c.edit(template_img, like_flood, "a hat", seed=seed, steps=STEPS)
        warm.append(r.latency_s)
        if seed and r.info.get("predicted_s", 0) <= 2 * r.info["answered_s"]:
            break
    # an edit's time: the fastest warm one after the cold first. The last one alone was once a hiccup of a host with
    # two CPU hogs beside it (8.4 s against the flood's edits' 3-6 s), and its 34 s bound refused nothing for time
    one = min(warm[1:])
    # ~20 requests get past Triton's queue (16 wait there), 4 to a batch: ~5 edits' time for all; 4 leaves some out
    # and, on a host whose load rises 3x as the flood lands (its own pre-processing), still lets the first in
    bound_s = max(1.5, 4 * one)
    # what lies outside the prediction: the step under way when a request runs out of its bound (a loaded host's
    # steps take up to seconds), decoding and the answer's way back, this client's own sending
    slack_s = max(3.0, bound_s / 2)
    n = 48
    masks = [samples.mask(256, 256, 0.3, "box", seed=i) for i in range(n)]
    with c:
        futs, took, sent = [], {}, []
        for i, m in enumerate(masks):
            t = time.monotonic()
            f = c.submit(template_img, m, "a red hat", seed=i, steps=STEPS, deadline_ms=int(bound_s * 1000))
            sent.append(time.time())  # it is stamped before submit returns: the server counts from no later
            f.add_done_callback(lambda _, i=i, t=t: took.__setitem__(i, time.monotonic() - t))
            futs.append(f)
        outcomes, infos = [], []
        for i, f in enumerate(futs):
            try:
                infos.append((i, f.result(timeout=300).info))
                outcomes.append(("ok", "", _took(took, i)))
            except EditError as e:
                outcomes.append((e.code, str(e), _took(took, i)))
            except TimeoutError:  # no answer: lost
                outcomes.append(("LOST", "", None))
    firsts = {}  # the first full text of each kind of answer, the times of all
    for code, m, _ in outcomes:
        firsts.setdefault((code, m[:50]), m)
    summary = (f"one edit {one:.2f} s, bound {bound_s:.1f} s; times {[(c, round(s or -1, 2)) for c, _, s in outcomes]};"
               f" texts {list(firsts.values())}")
    codes = {code for code, _, _ in outcomes}
    assert codes <= {"ok", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, summary  # answers and refusals, none lost
    at_queue = [s for code, m, s in outcomes if "Exceeds maximum queue size" in m]
    assert at_queue and max(at_queue) < 5.0, summary  # at once, however long the work in front of it
    by_time = [m for code, m, _ in outcomes if "cannot be answered within" in m or "would delay" in m or
               "can no longer be answered" in m]
    assert by_time, f"nothing was refused for time: {summary}"
    # admitted: served, or ended before a step that would take it past its bound (the host turned slower than
    # predicted when it was taken): either way answered within it
    assert any(code == "ok" or "ran out of its bound" in m for code, m, _ in outcomes), summary
    # the server counted each served request's bound from when it was sent, not from when pre-processing got to it
    counted = [(i, info.get("arrival_source"), round(info["arrival_ts"] - sent[i], 3)) for i, info in infos]
    assert all(src == "sender's stamp" and after <= 0 for _, src, after in counted), (counted, summary)
    # the server still serves
    with EditClient(server.grpc_url, timeout_s=120) as c:
        assert c.edit(template_img, box_mask, "a hat", seed=1, steps=2).image.size == (256, 256)
    # every request was answered within its bound: served, ended or refused (the stamp's fix: served requests were
    # counted from when pre-processing got to them). One open defect is told apart: pre-processing's refusals
    # "before any work" can come 0.5 s apart, because Triton's dynamic batcher (which holds the queue policy)
    # re-polls its queue every 0.5 s rather than being woken when the instance is free, so a flood's tail of them
    # ends late (quiet host: 2.05, 2.54 ... 4.95 s, 0.49 s apart, against 1.5 + 3 s; 2 runs in 6). Anything else
    # late fails.
    late = [(code, m, s) for code, m, s in outcomes if s > bound_s + slack_s]
    if late and all("refused before any work" in m for _, m, _ in late):
        pytest.xfail(f"refusals paced by Triton's batcher (0.5 s apart) came late: {[s for *_, s in late]}; {summary}")
    assert not late, summary


def _took(took: dict, i: int) -> float:
    """Request ``i``'s time from submission to its answer: its done callback runs just after ``result`` wakes."""
    end = time.monotonic() + 5.0
    while i not in took and time.monotonic() < end:
        time.sleep(0.001)
    return took[i]
