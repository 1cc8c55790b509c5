"""The Triton pods' readiness probe: a real edit request through the ensemble, run as Kubernetes runs it."""

import subprocess
import sys

from maskedit.launcher import free_port


def _probe(addr: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maskedit_router.probe", addr, "--timeout", "10"],
                          capture_output=True, text=True, timeout=60)


def test_probe_passes_on_a_serving_triton_and_fails_where_none_answers(server):
    ok = _probe(server.grpc_url)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    dead = _probe(f"127.0.0.1:{free_port()}")
    assert dead.returncode == 1 and "did not answer" in dead.stdout
