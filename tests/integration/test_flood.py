"""A flood straight at one server (no router in front): every request is answered (a result) or refused within its
bound of its arrival, none lost, and the server keeps serving afterwards.

Two bounds meet a flood. The ensemble's first step, ``intake`` (``maskedit.intake``), refuses what cannot wait in
front of pre-processing at once (16 wait there at most), before any pre-processing, with the request's own id (a
client with every request on one stream gets each answer). And the time bound (``maskedit.completion``): a request
predicted to be answered after its bound — the work ahead at the step time measured now — is refused before any
work, one that waited too long is refused when it reaches the front of the denoise queue, and one the host turned
too slow for ends at its bound. The bound here is the requests' DEADLINE_MS (the server's MASKEDIT_LATENCY_BOUND_S
is the same check, tightened by it; the session's server has a long one): several times what one edit takes on this
host just before the flood, so that it keeps its meaning on a loaded CI host — some of the flood fits in it, all of
it does not.

The bound counts from when the client sent each request (its stamp, ``maskedit.arrival``), however long it then
waited in front of pre-processing: the server's own EDIT_INFO must say so; an unstamped request is counted from
intake's floor, never later than it was sent. Until intake, Triton's queue policy on ``preprocess`` held the bound
of 16, and its dynamic batcher re-polled every 0.5 s instead of being woken when the instance freed: a flood's
refusals before any work came 0.49 s apart and the last were answered late (docs/reliability.md)."""

import json
import queue
import time

from maskedit import samples
from maskedit_client import EditClient, EditError
from maskedit_lab.reliability.pacing import refusal_flood

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
    # ~20 requests get past intake (16 wait in front of pre-processing), 4 to a batch: ~5 edits' time for all; 4 leaves some out
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
    # refused on arrival by intake: at once, however long the work in front of it (none on a host fast enough to
    # drain pre-processing's queue as the flood is sent; the answers' times below hold either way)
    at_intake = [s for code, m, s in outcomes if "pre-processing's queue is full" in m]
    assert not at_intake or max(at_intake) < 2.0, summary
    assert not any("Exceeds maximum queue size" in m for _, m, _ in outcomes), summary  # no Triton queue policy
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
    # counted from when pre-processing got to them; intake's: refusals before any work came 0.49 s apart)
    late = [(code, m, s) for code, m, s in outcomes if s > bound_s + slack_s]
    assert not late, summary


def test_refusals_before_any_work_are_not_paced(server, template_img, box_mask):
    """One edit keeps pre-processing busy, then 24 requests arrive at once on the same stream, each with a 1 ms
    DEADLINE_MS: every one is refused before any work, at intake (16 already waiting) or by the time bound when
    pre-processing reaches it, and pre-processing's refusals come back to back. Under Triton's queue policy on
    ``preprocess`` (before intake) its batcher handed pre-processing a request ~0.5 s after the last when nothing
    woke it: some consecutive refusals ~0.5 s apart, the last seconds after sending; this test failed on it
    (``maskedit_lab.reliability.pacing`` renders that repository beside this one and measures both)."""
    got = refusal_flood(server.grpc_url, 24, template_img, box_mask)
    whole = json.dumps(got)  # in full: pytest shortens a dict
    assert set(got["codes"]) <= {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"} and got["all_before_any_work"], whole
    assert got["at_pre_processing"] >= 8, whole  # at most 16 refused on arrival
    # the old batcher's re-polls left gaps of ~0.5 s, its last refusal 2.3-3.1 s after sending (pacing.json): one slow
    # gap is allowed, CI once saw a single 0.33 s gap among 16 refusals (not reproduced in 45 floods, quiet or beside
    # 2 CPU hogs)
    assert len(got["slow_gaps_s"]) <= 1 and got["gap_median_s"] < 0.05, whole
    assert got["last_after_s"] < 1.5, whole


def test_unstamped_waits_are_never_under_counted(server, template_img, box_mask):
    """Plain tritonclient (no stamp, no parameters): each served request's bound counted from intake's floor, at
    or before the time it was sent (same host, one clock)."""
    import tritonclient.grpc as grpcclient

    from maskedit_client.inputs import edit_inputs

    n, got = 12, queue.Queue()
    tc = grpcclient.InferenceServerClient(server.grpc_url)
    tc.start_stream(lambda result, error: got.put((result, error)))
    sent = {}
    try:
        for i in range(n):
            sent[f"u{i}"] = time.time()
            tc.async_stream_infer("edit", edit_inputs(template_img, box_mask, "a hat", seed=i, steps=2,
                                                      deadline_ms=600_000), request_id=f"u{i}")
        infos, errors = {}, []
        while len(infos) + len(errors) < n:
            result, error = got.get(timeout=300)
            if error is not None:
                errors.append(str(error))
            elif result.as_numpy("EDIT_INFO") is not None:
                info = json.loads(result.as_numpy("EDIT_INFO").reshape(-1)[0])
                infos[result.get_response().id] = info
    finally:
        tc.stop_stream()
        tc.close()
    assert infos, errors  # some were served (a slow host may refuse some for time: an answer, not tested here)
    counted = {rid: (info["arrival_source"], round(info["arrival_ts"] - sent[rid], 3)) for rid, info in infos.items()}
    assert all(src == "inferred" and after <= 0 for src, after in counted.values()), (counted, errors)


def _took(took: dict, i: int) -> float:
    """Request ``i``'s time from submission to its answer: its done callback runs just after ``result`` wakes."""
    end = time.monotonic() + 5.0
    while i not in took and time.monotonic() < end:
        time.sleep(0.001)
    return took[i]
