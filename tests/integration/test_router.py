"""The router in front of two real Triton instances, driven by tritonclient, the project's client and perf_analyzer."""

import csv
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from maskedit import perf_analyzer, samples
from maskedit.launcher import free_port
from maskedit_client import EditClient, EditError
from maskedit_lab.harness.cluster import running_cluster
from maskedit_router.placement.policies import POLICIES, make
from maskedit_router.proxy.server import backend_fault


@pytest.fixture(scope="module")
def cluster(settings, tmp_path_factory):
    http_port = free_port()
    health = {"interval_s": 0.5, "probe_every_s": 1.0, "probe_timeout_s": 3.0}
    with running_cluster(2, tmp_path_factory.mktemp("cluster"), http_port=http_port,
                         env={"MASKEDIT_MODEL_DIR": str(settings.model_dir)}, health=health,
                         supervise=False) as (router, url, servers):  # these tests keep a killed backend dead
        yield {"servers": servers, "router": router, "url": url, "http": http_port}


def _metric(cluster, name, **labels):
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster['http']}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_tritonclient_sees_a_triton_server(cluster):
    g = grpcclient.InferenceServerClient(cluster["url"])
    try:
        assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("edit")
        assert g.get_model_metadata("edit", as_json=True)["inputs"][0]["name"] == "TEMPLATE"
        assert g.get_model_config("masked_denoise", as_json=True)["config"]["model_transaction_policy"]["decoupled"]
        t = grpcclient.InferInput("REQUEST_IDS", [1], "BYTES")
        t.set_data_from_numpy(np.array([b"nobody"], dtype=np.object_))
        assert g.infer("cancel", [t]).as_numpy("CANCELLED")[0] == 1  # unary calls are forwarded too
    finally:
        g.close()
    health = urllib.request.urlopen(f"http://127.0.0.1:{cluster['http']}/health", timeout=5)
    assert health.status == 200


def test_streams_multiplex_requests_of_many_callers(cluster):
    tpl_a, tpl_b = samples.template(256, 256, seed=51), samples.template(256, 256, seed=52)
    with EditClient(cluster["url"]) as c:
        futs = [c.submit(tpl, samples.mask(256, 256, 0.1 + 0.05 * i, "box", seed=i), "a hat", seed=i, steps=2)
                for i, tpl in enumerate([tpl_a, tpl_b, tpl_a, tpl_b, tpl_a, tpl_b])]
        results = [f.result(120) for f in futs]
    assert all(r.image.size == (256, 256) for r in results)
    assert [r.info["seed"] for r in results] == list(range(6))  # every answer came back to its caller
    assert _metric(cluster, "maskedit_router_requests_total") >= 6
    assert _metric(cluster, "maskedit_router_decision_seconds_count") >= 6


def test_template_affinity_turns_into_cache_hits(cluster):
    """Edits of one template follow its activations: after the first (recording) request they all hit, which
    only the backend that recorded can do."""
    tpl = samples.template(256, 256, seed=53)
    with EditClient(cluster["url"]) as c:
        outcomes = []
        for i in range(5):
            r = c.edit(tpl, samples.mask(256, 256, 0.1, "box", seed=10 + i), "a hat", steps=3, seed=i)
            outcomes.append(r.info["cache"])
            time.sleep(0.3)  # the recording is written right after the first answer
    assert outcomes[0] == "record" and outcomes[-3:] == ["hit"] * 3, outcomes


def test_bad_request_errors_pass_through_with_the_clients_id(cluster, template_img, box_mask):
    with EditClient(cluster["url"]) as c:
        with pytest.raises(EditError) as e:
            c.edit(template_img, box_mask, "")
        assert e.value.code == "INVALID_ARGUMENT" and e.value.field == "PROMPT"
        assert c.edit(template_img, box_mask, "a hat", steps=2).image


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_routes_real_edits(cluster, policy):
    """Each policy (the same objects the simulator and the picker use) in front of the two real instances: edits of
    two templates all complete, the router's books balance again, and the affinity-aware ones keep a template on one
    backend (its later edits hit)."""
    router = cluster["router"]
    before = router.policy
    router.policy = make(policy, router.est)
    try:
        tpls = [samples.template(256, 256, seed=900 + 2 * POLICIES.index(policy) + k) for k in range(2)]
        with EditClient(cluster["url"]) as c:
            firsts = [c.edit(t, samples.mask(256, 256, 0.1, "box", seed=k), "a hat", steps=2, seed=k)
                      for k, t in enumerate(tpls)]
            time.sleep(0.3)  # the recordings are written right after the first answers
            futs = [c.submit(tpls[i % 2], samples.mask(256, 256, 0.1, "box", seed=10 + i), "a hat", steps=2, seed=i)
                    for i in range(6)]
            results = [f.result(120) for f in futs]
        assert [r.info["cache"] for r in firsts] == ["record", "record"]
        assert all(r.image.size == (256, 256) for r in results)
        if policy in ("predicted", "chwbl", "weighted"):
            assert sum(r.info["cache"] == "hit" for r in results) >= 4, [r.info["cache"] for r in results]
        assert _metric(cluster, "maskedit_router_requests_total", policy=policy) >= 8
        deadline = time.monotonic() + 10
        while any(b.load.inflight for b in router.backends.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(b.load.inflight == 0 and b.load.work == 0 for b in router.backends.values())
    finally:
        router.policy = before


def _http(cluster, path, body=None, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{cluster['http']}{path}", data=body, headers=headers or {},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_triton_http_protocol_through_the_router(cluster, template_img, box_mask):
    """KServe v2 HTTP on the router's HTTP port: health, metadata, generate, generate_stream and infer, each through
    the router's routing (its request counter moves)."""
    import base64
    import json

    from tests.conftest import png

    assert _http(cluster, "/v2/health/live")[0] == 200 and _http(cluster, "/v2/health/ready")[0] == 200
    assert _http(cluster, "/v2/models/edit/ready")[0] == 200
    meta = json.loads(_http(cluster, "/v2/models/edit")[2])
    assert meta["name"] == "edit" and meta["inputs"][0]["name"] == "TEMPLATE"
    assert json.loads(_http(cluster, "/v2/models/masked_denoise/config")[2])["model_transaction_policy"]["decoupled"]
    routed = _metric(cluster, "maskedit_router_requests_total")
    doc = {"TEMPLATE": base64.b64encode(png(template_img)).decode(), "MASK": base64.b64encode(png(box_mask)).decode(),
           "PROMPT": "a yellow sun hat", "SEED": 7, "STEPS": 2}
    status, _, body = _http(cluster, "/v2/models/edit/generate", json.dumps(doc).encode())
    assert status == 200, body
    out = json.loads(body)
    assert base64.b64decode(out["IMAGE"])[:8] == b"\x89PNG\r\n\x1a\n" and json.loads(out["EDIT_INFO"])["seed"] == 7
    status, headers, body = _http(cluster, "/v2/models/edit/generate_stream",
                                  json.dumps({**doc, "PROGRESS": True}).encode())
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert len(events) >= 2 and "IMAGE" in events[-1], events[:1]
    # infer: KServe v2 JSON tensors; the PNG answer comes back in the binary extension
    infer = {"inputs": [{"name": "TEMPLATE", "shape": [1], "datatype": "BYTES", "data": [doc["TEMPLATE"]]},
                        {"name": "MASK", "shape": [1], "datatype": "BYTES", "data": [doc["MASK"]]},
                        {"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["a hat"]},
                        {"name": "STEPS", "shape": [1], "datatype": "INT32", "data": [2]}]}
    status, _, body = _http(cluster, "/v2/models/edit/infer", json.dumps(infer).encode())
    assert status == 200, body
    outputs = {o["name"]: o for o in json.loads(body)["outputs"]}
    assert set(outputs) >= {"IMAGE", "EDIT_INFO"}
    assert _metric(cluster, "maskedit_router_requests_total") >= routed + 3
    # a bad request: the backend's INVALID_ARGUMENT as a 400 naming the field
    status, _, body = _http(cluster, "/v2/models/edit/generate", json.dumps({**doc, "PROMPT": ""}).encode())
    assert status == 400 and b"PROMPT" in body
    assert _http(cluster, "/v2/models/edit/generate", json.dumps({**doc, "NOPE": 1}).encode())[0] == 400


def test_adapters_pass_through_the_router_over_grpc_and_http_generate_and_its_books_see_them(
        cluster, adapters, template_img, box_mask):
    """``LORAS`` through the router's gRPC port and its KServe generate endpoint: the same adapted image both ways
    (not the plain one); the router books the adapter on the backend it chose; a bad adapter's error passes
    through naming LORAS."""
    import base64
    import json

    from tests.conftest import png

    kw = dict(seed=6, steps=2, use_cache=False)
    with EditClient(cluster["url"], timeout_s=120) as c:
        adapted = np.asarray(c.edit(template_img, box_mask, "a hat", loras=[("attn-r4", 0.9)], **kw).image, int)
        plain = np.asarray(c.edit(template_img, box_mask, "a hat", **kw).image, int)
        with pytest.raises(EditError) as e:
            c.edit(template_img, box_mask, "a hat", loras=[("nope", 1.0)], **kw)
        assert e.value.code == "INVALID_ARGUMENT" and e.value.field == "LORAS" and "nope" in str(e.value)
    assert np.abs(adapted - plain).max() > 10
    now = time.monotonic()
    assert any(b.load.adapters.holds("attn-r4", now) for b in cluster["router"].backends.values())
    doc = {"TEMPLATE": base64.b64encode(png(template_img)).decode(), "MASK": base64.b64encode(png(box_mask)).decode(),
           "PROMPT": "a hat", "SEED": 6, "STEPS": 2, "USE_CACHE": False,
           "LORAS": json.dumps([{"name": "attn-r4", "scale": 0.9}])}
    status, _, body = _http(cluster, "/v2/models/edit/generate", json.dumps(doc).encode())
    assert status == 200, body
    from PIL import Image
    import io

    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(json.loads(body)["IMAGE"]))), int)
    assert np.abs(got - adapted).max() <= 1


def test_perf_analyzer_through_the_router(cluster, tmp_path):
    """Concurrency 1 and 2 on perf_analyzer's own streams; at 2 the router must not add seconds (it once did: two
    instances on one host each ran their denoise loop on every core, and OpenMP oversubscription stalled steps)."""
    proc = perf_analyzer.run(cluster["url"], tmp_path / "r.csv", concurrency="1:2", request_count=12)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # perf_analyzer writes its rows in order of throughput: on a loaded host concurrency 2 may come first
    rows = sorted(csv.DictReader((tmp_path / "r.csv").open()), key=lambda r: int(r["Concurrency"]))
    assert [r["Concurrency"] for r in rows] == ["1", "2"]
    assert all(float(r["Inferences/Second"]) > 0 for r in rows)
    p95 = {r["Concurrency"]: int(r["p95 latency"]) for r in rows}  # microseconds
    assert p95["2"] < 4 * p95["1"], p95


def test_killing_a_backend_under_load_ends_every_request(cluster, template_img):
    """Every request ends in a result or a clear error; later requests go to the survivor."""
    outcomes = []
    with EditClient(cluster["url"]) as c:
        futs = [c.submit(samples.template(256, 256, seed=60 + i), samples.mask(256, 256, 0.2, "blob", seed=i),
                         "a hat", steps=40, use_cache=False) for i in range(8)]
        time.sleep(0.5)
        victim = cluster["servers"][1]
        assert list(Path("/dev/shm").glob(f"{victim.shm_prefix}*"))  # its Python backend's regions
        victim.stop(timeout=0.1)  # SIGTERM then SIGKILL of the whole process group
        assert not list(Path("/dev/shm").glob(f"{victim.shm_prefix}*"))  # a killed server leaves none behind
        for f in futs:
            try:
                outcomes.append(("ok", f.result(120).image.size))
            except EditError as e:
                outcomes.append(("error", e.code))
        assert len(outcomes) == 8
        assert all(o[0] == "ok" or o[1] in ("UNAVAILABLE", "CANCELLED", "UNKNOWN") for o in outcomes)
        deadline = time.time() + 20
        while cluster["router"].backends[victim.grpc_url].load.healthy and time.time() < deadline:
            time.sleep(0.2)
        assert not cluster["router"].backends[victim.grpc_url].load.healthy
        for i in range(3):
            assert c.edit(template_img, samples.mask(256, 256, 0.1, "box", seed=i), "a hat", steps=2).image


def _stub_pid(server, model: str) -> int:
    """The pid of ``model``'s Python-backend stub among ``server``'s processes."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.getpgid(int(d.name)) == server.proc.pid and \
                    f"{model}_0_0".encode() in (d / "cmdline").read_bytes().split(b"\0"):
                return int(d.name)
        except OSError:  # gone meanwhile
            continue
    raise LookupError(f"no stub for {model} under pid {server.proc.pid}")


def test_a_request_stuck_on_a_crashed_denoise_stub_ends_when_the_backend_is_found_unhealthy(cluster):
    """Triton 2.51 does not restart a crashed decoupled stub, keeps saying ready, and never answers the requests
    that were in flight in it: the router's probe request must find the backend unhealthy, and the stuck request
    must end then, not when the client gives up. (Runs after the kill test: the other backend is gone, so the
    stuck request has nowhere to be retried and ends in an error.)"""
    victim = cluster["servers"][0]
    backend = cluster["router"].backends[victim.grpc_url]
    with EditClient(cluster["url"]) as c:
        denoising = threading.Event()
        stuck = c.submit(samples.template(256, 256, seed=7), samples.mask(256, 256, 0.2, "blob", seed=7), "a hat",
                         steps=100, use_cache=False, on_progress=lambda *_: denoising.set())
        assert denoising.wait(60)
        os.kill(_stub_pid(victim, "masked_denoise"), signal.SIGKILL)
        assert not stuck.done()
        t0 = time.time()
        g = grpcclient.InferenceServerClient(victim.grpc_url)
        try:
            assert g.is_server_ready()  # still says ready: readiness alone cannot see it
        finally:
            g.close()
        with pytest.raises(EditError) as err:
            stuck.result(60)
        assert err.value.code == "UNAVAILABLE" and time.time() - t0 < 30, (str(err.value), time.time() - t0)
    assert not backend.load.healthy
    # A new request to that instance is answered at once with an error the router reads as a dead backend (retry
    # elsewhere, out of rotation), not as a live backend rejecting one request: the unit tests' message is real.
    with EditClient(victim.grpc_url) as direct, pytest.raises(EditError) as err:
        direct.edit(samples.template(256, 256, seed=8), samples.mask(256, 256, 0.2, "blob", seed=8), "a hat",
                    steps=2, use_cache=False)
    assert backend_fault(str(err.value)), str(err.value)
