import subprocess
import sys

from PIL import Image

from tests.conftest import png


def _run(server, tmp_path, *extra):
    return subprocess.run([sys.executable, "-m", "maskedit_client.cli", "--url", server.grpc_url,
                           "--template", str(tmp_path / "t.png"), "--mask", str(tmp_path / "m.png"), *extra],
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_result_and_reports_errors(server, tmp_path, template_img, box_mask):
    (tmp_path / "t.png").write_bytes(png(template_img))
    (tmp_path / "m.png").write_bytes(png(box_mask))
    ok = _run(server, tmp_path, "--prompt", "a hat", "--steps", "2", "--out", str(tmp_path / "r.png"))
    assert ok.returncode == 0, ok.stderr
    assert Image.open(tmp_path / "r.png").size == template_img.size
    assert "2/2" in ok.stderr  # the progress bar ends at N/N (the last step's progress is the result)
    bad = _run(server, tmp_path, "--prompt", "", "--out", str(tmp_path / "x.png"))
    assert bad.returncode == 1 and "error: INVALID_ARGUMENT: PROMPT: is empty" in bad.stderr
    assert bad.stderr.count("INVALID_ARGUMENT") == 1 and "denoising" not in bad.stderr  # code once, no empty bar
    assert not (tmp_path / "x.png").exists()
