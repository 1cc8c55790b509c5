"""`make serve INSTANCES=2`'s path (``python -m maskedit_lab.harness.cluster --instances 2``) with a key file in the
settings, as a user starts it: every router port refuses a keyless caller (gRPC UNAUTHENTICATED, Triton's HTTP protocol
and the OpenAI API 401), a caller with the key edits, and the backends, guarded by the backend key the launcher made,
refuse a keyless caller that goes straight to them (gRPC and HTTP) while their health stays open. The control: the
same direct call with the backend key is served, so the refusal is the key's, not a broken backend's."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from maskedit.launcher import free_ports
from maskedit.settings import REPO_ROOT
from maskedit_client import EditClient, EditError
from maskedit_common import backend_guard
from tests.conftest import png

KEY = "sk-launch-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster(settings, tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    keys = d / "keys.txt"
    keys.write_text(f"{KEY} acme user\n")
    grpc_port, http_port, openai_port = free_ports(3)
    env = {**os.environ, "MASKEDIT_MODEL_DIR": str(settings.model_dir), "MASKEDIT_API_KEYS_FILE": str(keys)}
    env.pop("MASKEDIT_BACKEND_KEY_FILE", None)
    log = open(d / "cluster.log", "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "maskedit_lab.harness.cluster", "--instances", "2",
                             "--port", str(grpc_port),
                             "--http-port", str(http_port), "--openai-port", str(openai_port), "--out", str(d / "out")],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        line = proc.stdout.readline()  # the JSON line, once the backends and the router are up
        assert line, f"the cluster exited with {proc.wait(30)}: {(d / 'cluster.log').read_text()[-3000:]}"
        info = json.loads(line)
        _wait_ready(http_port)
        yield {**info, "grpc": f"127.0.0.1:{grpc_port}", "http": http_port, "openai": openai_port,
               "log": d / "cluster.log", "backend_key_file": d / "out" / "backend.key"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the cluster stops its servers by pid on the way out
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()
        log.close()


def _wait_ready(http_port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as r:
                if json.loads(r.read()).get("ready"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the router never had a backend in rotation")


def _status(url: str, data: bytes | None = None, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers or {}), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_every_router_port_refuses_a_keyless_caller_and_the_key_edits(cluster, template_img, box_mask):
    assert cluster["api_keys"] and cluster["backend_key"] and len(cluster["backends"]) == 2
    with EditClient(cluster["grpc"], timeout_s=30, retry=False) as c:
        with pytest.raises(EditError) as e:
            c.edit(template_img, box_mask, "a red hat", seed=1, steps=2)
        assert e.value.code == "UNAUTHENTICATED"
    assert _status(f"http://127.0.0.1:{cluster['http']}/v2/models/edit") == 401
    assert _status(f"http://127.0.0.1:{cluster['http']}/v2/models/edit/infer", b"{}") == 401
    boundary = "x0x0x0"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na red hat\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"t.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + png(template_img) + f"\r\n--{boundary}--\r\n".encode()
    assert _status(f"http://127.0.0.1:{cluster['openai']}/v1/images/edits", form,
                   {"Content-Type": f"multipart/form-data; boundary={boundary}"}) == 401
    # with the key, through the guarded backends (the router sends them the backend key)
    with EditClient(cluster["grpc"], api_key=KEY, timeout_s=180) as c:
        assert c.edit(template_img, box_mask, "a red hat", seed=1, steps=2).image.size == (256, 256)
    text = Path(cluster["log"]).read_text()
    assert "API key" in text and "open mode" not in text
    assert "backend key on" in text


def test_a_keyless_call_straight_to_a_backend_is_refused_and_its_health_stays_open(cluster, template_img, box_mask):
    grpc_url, http_url = cluster["backends"][0], cluster["backends_http"][0]
    with EditClient(grpc_url, timeout_s=30, retry=False) as c:
        with pytest.raises(EditError) as e:
            c.edit(template_img, box_mask, "a red hat", seed=1, steps=2)
        assert "restricted" in str(e.value), str(e.value)
    assert _status(f"http://{http_url}/v2/models/edit") == 403
    assert _status(f"http://{http_url}/v2/models/edit/infer", b"{}") == 403
    assert _status(f"http://{http_url}/v2/health/ready") == 200
    # the control: the same call with the backend key is served
    key = backend_guard.read(cluster["backend_key_file"])
    assert _status(f"http://{http_url}/v2/models/edit", headers={backend_guard.HEADER: key}) == 200
    with EditClient(grpc_url, timeout_s=180, headers=dict(backend_guard.grpc_metadata(key))) as c:
        assert c.edit(template_img, box_mask, "a red hat", seed=1, steps=2).image.size == (256, 256)
