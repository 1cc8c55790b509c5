"""Every runnable example of README.md and docs/ (``tests/doc_examples.py``) run as a user pastes it: in a fresh
directory holding ``.venv`` and the example inputs ``make demo`` / ``make serve`` write to ``out/``, against the
suite's Triton server (``make serve``) and against the router in front of it (``make serve INSTANCES=2``: the ports
mapped as README says, 8001 -> 7001, 8000 -> 7002). Each must exit 0, print no traceback, and write only under
``out/``, where the PNGs it wrote must open. A README change that breaks an example fails here."""

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from maskedit import samples
from maskedit.launcher import free_ports
from maskedit_lab.harness.cluster import running_router
from tests.doc_examples import RUN_KINDS, blocks, with_ports

EXAMPLES = [b for b in blocks() if b.kind in RUN_KINDS]
CASES = [(b, mode) for b in EXAMPLES for mode in (("single", "router") if b.kind == "both" else ("router",))]


@pytest.fixture(scope="module")
def routed(server, adapters, controlnets):
    """The router in front of the suite's server, on its own HTTP and OpenAI ports (no more Triton servers)."""
    http, openai = free_ports(2)
    with running_router([server.grpc_url], http_port=http, openai_port=openai) as (_, url):
        yield {"router_grpc": int(url.rsplit(":", 1)[1]), "router_http": http, "openai": openai}


def _ports(mode, server, routed) -> dict:
    if mode == "single":
        return {"http": server.http_port, "grpc": server.grpc_port, "metrics": server.metrics_port}
    # behind the router: its gRPC port for 8001, its HTTP port (/v2, /metrics, /health) for 8000 and 8002
    return {**routed, "grpc": routed["router_grpc"], "http": routed["router_http"], "metrics": routed["router_http"]}


def _snapshot(d: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}


@pytest.mark.parametrize("block,mode", CASES, ids=[f"{b.name}-{m}" for b, m in CASES])
def test_example_runs_as_written(block, mode, server, routed, tmp_path):
    samples.write_examples(tmp_path / "out")  # what `make demo` and `make serve` write
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the checkout's venv, as the examples name it
    before = _snapshot(tmp_path / "out")
    text = with_ports(block.text, _ports(mode, server, routed))
    cmd = ["bash", "-euo", "pipefail", "-c", text] if block.lang == "bash" else [sys.executable, "-c", text]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    said = f"{block.name} ({mode}):\n{text}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-3000:]}"
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, said
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv", "out"], f"wrote outside out/: {said}"
    written = [p for p, t in _snapshot(tmp_path / "out").items() if before.get(p) != t]
    assert any(p.suffix == ".png" for p in written), f"no image written: {said}"
    for p in written:
        if p.suffix == ".png":
            assert Image.open(p).size == (384, 288), p  # the template's size: an edit result
