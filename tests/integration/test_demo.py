"""`make demo`'s main job runs end to end (its own server on free ports) and writes what it promises."""

import subprocess
import sys

from PIL import Image


def test_demo_writes_results_and_contact_sheet(settings, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "maskedit.demo", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("small_box", "medium_blob", "large_person"):
        assert Image.open(tmp_path / f"result_{name}.png").size == Image.open(tmp_path / "template.png").size
        assert f"{name}" in proc.stdout and "latency" in proc.stdout
    sheet = Image.open(tmp_path / "contact_sheet.png")
    assert sheet.size[0] == 3 * 384
    assert "server stopped" in proc.stdout
