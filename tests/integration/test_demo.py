"""`make demo`'s main job runs end to end (its own server on free ports), writes what it promises, and leaves nothing
behind in /dev/shm (its run's directories are removed with the server)."""

import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

from maskedit.scratch import SCRATCH_VARS


def _run_dirs() -> set[str]:
    shm = Path("/dev/shm")
    uid = os.getuid()
    return {p.name for p in shm.glob(f"maskedit-{uid}*")} if shm.is_dir() else set()


def test_demo_writes_results_and_contact_sheet_and_leaves_nothing(settings, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in SCRATCH_VARS}  # the demo's own defaults, as `make demo`
    before = _run_dirs()
    proc = subprocess.run([sys.executable, "-m", "maskedit.demo", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("small_box", "medium_blob", "large_person"):
        assert Image.open(tmp_path / f"result_{name}.png").size == Image.open(tmp_path / "template.png").size
        assert f"{name}" in proc.stdout and "latency" in proc.stdout
    sheet = Image.open(tmp_path / "contact_sheet.png")
    assert sheet.size[0] == 3 * 384
    assert Image.open(tmp_path / "edges.png").size == Image.open(tmp_path / "template.png").size
    assert "server stopped" in proc.stdout
    assert _run_dirs() <= before, "the demo left its host-memory directories in /dev/shm"
