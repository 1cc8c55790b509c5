"""The supervisor's view of a backend: dead when its server exited or one of its stubs died; reaping leaves no
process of its group and no shared-memory region. Real processes (a shell standing in for tritonserver, its
children for the stubs); the integration chaos tests do the same with real Triton servers."""

import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from maskedit_lab.harness.supervisor import Instance, group_members, reap, stubs_of, why_dead


class _Server:
    """What the supervisor uses of a TritonServer: proc, shm_prefix, stop()."""

    def __init__(self):
        self.proc = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
        self.shm_prefix = f"maskedit_test_{os.getpid()}_{id(self)}"
        (Path("/dev/shm") / f"{self.shm_prefix}_region").write_bytes(b"x")
        deadline = time.monotonic() + 5
        while len(psutil.Process(self.proc.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, timeout=0.1):
        if self.proc is not None:
            self.proc.wait(5)
            for r in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
                r.unlink()
            self.proc = None


def test_a_dead_stub_makes_the_backend_dead_and_reaping_leaves_nothing():
    s = _Server()
    pgid = s.proc.pid
    try:
        inst = Instance(s, stubs_of(s))
        assert len(inst.stubs) == 2 and why_dead(inst) is None
        victim = next(iter(inst.stubs))
        os.kill(victim, 9)
        deadline = time.monotonic() + 5
        while why_dead(inst) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"stub {victim}" in why_dead(inst)
        assert reap(s) >= 2  # the server and the surviving stub
        assert group_members(pgid) == [] and not list(Path("/dev/shm").glob(f"{s.shm_prefix}*"))
    finally:
        if s.proc is not None:
            os.killpg(pgid, 9)
            s.stop()


def test_a_server_stopped_by_its_owner_is_left_alone():
    assert why_dead(Instance(SimpleNamespace(proc=None))) is None


class _ModelControl:
    """Triton's HTTP model-control routes as the supervisor uses them: the config, and a load that records what it
    was sent (``fail``: answered 400, as a model that cannot load)."""

    def __init__(self, fail: bool = False):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.loads = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = json.dumps({"name": "masked_denoise", "backend": "python", "parameters": {}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                outer.loads.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                self.send_response(400 if fail else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.http_url = f"127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()


def test_a_reload_sends_the_models_config_with_a_new_generation_so_triton_loads_it_again():
    """Triton answers a load of an unchanged, loaded model at once and does nothing (measured: the dead stub stayed
    dead); a changed configuration makes it start a new instance."""
    import json

    from maskedit_lab.harness.supervisor import GENERATION, reload_model

    api = _ModelControl()
    try:
        reload_model(api, "masked_denoise")
        reload_model(api, "masked_denoise")
    finally:
        api.close()
    (path, first), (_, second) = api.loads
    assert path == "/v2/repository/models/masked_denoise/load"
    configs = [json.loads(b["parameters"]["config"]) for b in (first, second)]
    assert all(c["name"] == "masked_denoise" for c in configs)
    gens = [c["parameters"][GENERATION]["string_value"] for c in configs]
    assert gens[0] != gens[1]


def test_a_dead_stub_is_reloaded_alone_and_a_failed_reload_falls_back_to_the_restart():
    from maskedit_lab.harness.supervisor import RELOADABLE_ARGS, Stub, Supervisor

    s = _Server()
    pgid = s.proc.pid
    region = Path("/dev/shm") / f"{s.shm_prefix}_stub"
    try:
        for fail in (False, True):
            region.write_bytes(b"x")
            api = _ModelControl(fail=fail)
            s.http_url, s.grpc_url, s.extra_args = api.http_url, "127.0.0.1:1", list(RELOADABLE_ARGS)
            inst = Instance(s, stubs_of(s))
            dead = Stub(psutil.Process(next(iter(inst.stubs))), "masked_denoise_0_0", "masked_denoise", region.name)
            try:
                assert Supervisor([])._reload(inst, dead) is (not fail)
            finally:
                api.close()
            assert len(api.loads) == 1
            assert inst.total_reloads == (0 if fail else 1) and region.exists() == fail  # its region removed
        region.unlink()
        inst = Instance(SimpleNamespace(proc=s.proc, extra_args=[]), {})  # started without model control
        assert Supervisor([])._reload(inst, dead) is False
    finally:
        os.killpg(pgid, 9)
        s.stop()
