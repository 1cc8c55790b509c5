"""Load generator against the real server; progress responses, deadlines and cancellation end cleanly."""

import threading
import time

import numpy as np
import pytest

from loadgen import records, runner, workload
from maskedit.repository import PASSTHROUGH, PREPARED
from maskedit_client import EditClient, EditError


def test_loadgen_poisson_run_records_every_request(server, tmp_path):
    reqs = workload.poisson(8.0, 8, workload="tryon", steps=2, seed=3)
    with EditClient(server.grpc_url) as c:
        recs, wall = runner.run(c, reqs, runner.Assets(256), progress=False, register_templates=True)
    s = records.summarize(recs, wall)
    assert s["completed"] == 8 and not s["errors"] and s["p95_s"] >= s["p50_s"] > 0
    assert all(r.first_progress_s is not None and r.first_progress_s <= r.done_s for r in recs)
    assert s["cache_hit_rate"] > 0
    records.write(recs, s, tmp_path, "run")
    records.plot_runs({"run": (recs, dict(s, rate=8.0))}, tmp_path / "run.png")
    assert (tmp_path / "run.csv").read_text().count("\n") == 9 and (tmp_path / "run.png").stat().st_size > 0


def test_progress_is_reported_per_step(client, template_img, box_mask):
    seen = []
    r = client.edit(template_img, box_mask, "a hat", steps=4, on_progress=lambda i, n: seen.append((i, n)))
    assert seen == [(1, 4), (2, 4), (3, 4)] and r.progress == seen and r.image.size == template_img.size


def test_hopeless_deadline_fails_fast(client, template_img, box_mask):
    """Refused before any step runs (no step's progress came), not after denoising: that is what "fast" means here,
    whatever the host's load; the wall-clock bound only tells it from a run of all 100 steps."""
    steps = []
    t0 = time.perf_counter()
    with pytest.raises(EditError) as e:
        client.edit(template_img, box_mask, "a hat", steps=100, deadline_ms=1, use_cache=False,
                    on_progress=lambda i, n: steps.append(i))
    assert e.value.code == "DEADLINE_EXCEEDED" and steps == [] and time.perf_counter() - t0 < 30
    assert client.edit(template_img, box_mask, "a hat", steps=2).image  # still serving


def _cancelled(server) -> int:
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(r'maskedit_denoise_requests_total\{code="CANCELLED"\} (\d+)', text)
    return int(m.group(1)) if m else 0


def _stage_inputs(server, template_img, box_mask, steps):
    import tritonclient.grpc as grpcclient

    from tests.conftest import png

    g = grpcclient.InferenceServerClient(server.grpc_url)
    ins = []
    for name, value in [("TEMPLATE", png(template_img)), ("MASK", png(box_mask)), ("PROMPT", b"a hat")]:
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value], dtype=np.object_))
        ins.append(t)
    for name, value, dt, npt in [("STEPS", steps, "INT32", np.int32), ("USE_CACHE", False, "BOOL", np.bool_),
                                 ("PROGRESS", True, "BOOL", np.bool_)]:
        t = grpcclient.InferInput(name, [1], dt)
        t.set_data_from_numpy(np.array([value], dtype=npt))
        ins.append(t)
    pre = g.infer("preprocess", ins)
    out = []
    for n in [t.name for t in (*PREPARED, *PASSTHROUGH)]:  # what the ensemble hands masked_denoise
        a = pre.as_numpy(n)
        t = grpcclient.InferInput(n, list(a.shape), grpcclient.np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a)
        out.append(t)
    return g, out


def test_cancelled_request_leaves_the_batch_at_the_next_step(server, template_img, box_mask):
    """Cancelling the stream of a masked_denoise request removes it from the running batch (counted as
    CANCELLED, no final result). Triton 2.51 does not forward a client's cancel into a step of an ensemble, so
    through `edit` the request runs on; see README."""
    before = _cancelled(server)
    g, ins = _stage_inputs(server, template_img, box_mask, steps=100)
    got = []
    started = threading.Event()

    def cb(result, error):
        got.append((result, error))
        started.set()

    try:
        g.start_stream(callback=cb)
        g.async_stream_infer("masked_denoise", ins, request_id="c1")
        assert started.wait(30)  # a progress response: it is in the running batch
        g.stop_stream(cancel_requests=True)
    finally:
        g.close()
    deadline = time.time() + 10
    while _cancelled(server) < before + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert _cancelled(server) == before + 1
    assert len(got) < 100  # it did not run its 100 steps
    with EditClient(server.grpc_url) as c2:
        assert c2.edit(template_img, box_mask, "a hat", steps=2).image


def test_closing_the_client_cancels_through_the_ensemble(server, template_img, box_mask):
    before = _cancelled(server)
    c = EditClient(server.grpc_url)
    started = [threading.Event() for _ in range(2)]
    futs = [c.submit(template_img, box_mask, "a hat", steps=100, use_cache=False,
                     on_progress=lambda i, n, e=e: e.set()) for e in started]
    assert all(e.wait(30) for e in started)  # both are in the running batch
    c.close()  # cancels them with the cancel model, then closes the stream
    for f in futs:
        with pytest.raises(EditError) as e:
            f.result(10)
        assert e.value.code == "CANCELLED"
    deadline = time.time() + 10
    while _cancelled(server) < before + 2 and time.time() < deadline:
        time.sleep(0.1)
    assert _cancelled(server) == before + 2
