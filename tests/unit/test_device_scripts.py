"""Every device script's CPU dry run: the same script, the same imports and the same commands as on the GPU machine,
with tiny presets and one step (``tools/device/gpu_check.sh --dry-run MODE...``, whose ``tests`` mode runs tests/gpu
with ``DEVICE=cpu``; ``triton_pack.sh`` and ``wheels.sh --dry-run``). A refactor that breaks a command these scripts
run fails here, not in the few minutes a GPU is lent for."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "tools" / "device"
ENGINE_MODES = ("tests", "calibrate", "bench", "loader", "unet")  # serving starts tritonserver: its own, integration, test


def run(script: str, *args: str, timeout: int = 900, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEVICE / script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The engine's modes in one call, as one GPU session runs them: ``bench`` uses ``calibrate``'s profile."""
    out = tmp_path_factory.mktemp("device")
    return run("gpu_check.sh", "--dry-run", *ENGINE_MODES, OUT=str(out)), out


def _rows(path: Path) -> list:
    return json.loads(path.read_text())["rows"]


def _all_ran(log: str) -> bool:
    """Every GPU test ran (on the CPU), none skipped or failed."""
    return re.search(r"\b\d+ passed\b", log) is not None and not re.search(r"skipped|failed|error", log)


def _calibrated(path: Path) -> bool:
    """A profile with a time for every block kind and mode (a one-step calibration once wrote an empty one)."""
    profile = json.loads(path.read_text())
    compute = profile["compute"]
    return (bool(compute) and all(set(modes) == {"full", "y", "kv"} for modes in compute.values())
            and {"mem", "disk", "verify"} <= set(profile["load"]))  # loads priced with their checksums


# What each mode leaves in $OUT besides its logs.
CHECKS = {
    "tests": lambda o: _all_ran((o / "gpu_tests.log").read_text()),
    "calibrate": lambda o: _calibrated(o / "cost_model_tiny-flux-fill.json"),
    "bench": lambda o: {r["mode"] for r in _rows(o / "engine_cpu.json")} >= {"full", "planner"},
    "loader": lambda o: [r["verify_threads"] for r in _rows(o / "loader_cpu.json")][0] == 1,
    "unet": lambda o: _calibrated(o / "cost_model_sdxl-tiny.json") and _rows(o / "engine_sdxl_cpu.json"),
}


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_the_gpu_check_runs_on_the_cpu(mode, engine_run):
    r, out = engine_run
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"== {mode}" in r.stdout and CHECKS[mode](out), r.stdout[-4000:]


@pytest.mark.integration
def test_the_gpu_checks_serving_benchmark_compares_the_service_with_the_baseline_on_the_cpu(tmp_path):
    """Also the serving benchmark's minimal run (both systems behind real tritonservers, 3 requests each)."""
    r = run("gpu_check.sh", "--dry-run", "serving", OUT=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    result = json.loads((tmp_path / "serving_cpu.json").read_text())
    rows = {row["system"]: row for row in result["rows"]}
    assert set(rows) == {"diffusers", "service"} and all(row["completed"] == 3 for row in rows.values())
    assert result["meta"]["capacity_from"] == "diffusers" and result["meta"]["capacity_req_s"] > 0
    (ratio,) = result["ratios"]
    assert ratio["system"] == "service" and ratio["mean_vs_diffusers"] > 0
    assert (tmp_path / "serving_cpu.png").exists()


def test_the_gpu_check_stops_at_the_first_failing_command(tmp_path):
    """The control: a failing command fails the run (the script once went on past an ImportError)."""
    r = run("gpu_check.sh", "--dry-run", "tests", timeout=120, OUT=str(tmp_path), PYTHON="false")
    assert r.returncode != 0
    assert not (tmp_path / "gpu_tests.log").exists()


def test_the_gpu_check_refuses_an_unknown_mode_before_it_starts(tmp_path):
    r = run("gpu_check.sh", "--dry-run", "tests", "bnech", timeout=60, OUT=str(tmp_path))
    assert r.returncode == 2 and "not 'bnech'" in r.stdout
    assert not (tmp_path / "gpu.txt").exists()


def test_the_tritonserver_pack_finds_what_it_copies():
    r = run("triton_pack.sh", "--dry-run", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "would write .whl/tritonserver.tar.xz" in r.stdout


def test_the_devices_wheels_are_the_versions_the_project_pins(tmp_path):
    r = run("wheels.sh", "--dry-run", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("would run: python3 -m pip download") == 4 and "diffusers==0.42.1" in r.stdout
    assert "xxhash==4.1.0" in r.stdout  # the image's own is of unknown version (the verify threads need >= 3.0)
    pins = tmp_path / "requirements.txt"
    pins.write_text("diffusers==0.41.0  # another pin than the device's wheel\n")
    r = run("wheels.sh", "--dry-run", timeout=60, REQUIREMENTS=str(pins))
    assert r.returncode != 0 and "diffusers" in r.stdout


def test_a_lease_runs_every_stage_past_one_that_overruns_and_packs_what_they_wrote(tmp_path):
    """``lease.sh`` as one device call runs it: a stage killed at its limit does not stop the next, and $OUT holds
    the log and one archive of every stage's files (the device returns at most 8 files)."""
    out = tmp_path / "out"
    r = run("lease.sh", "--dry-run", OUT=str(out), STAGES="tests:1 loader:300", LEASE_WORK=str(tmp_path / "work"),
            MASKEDIT_MODEL_DIR=str(tmp_path / "model"))  # what the killed tests stage builds, in this test's place
    assert r.returncode == 124, r.stdout[-4000:] + r.stderr[-2000:]  # the first failed stage's status
    log = (out / "lease.log").read_text()
    assert "== tests: exit 124" in log and "== loader: exit 0" in log, log[-3000:]
    import tarfile
    with tarfile.open(out / "lease.tgz") as t:
        names = {Path(n).name for n in t.getnames()}
    assert {"loader_cpu.json", "loader_cpu.png", "loader.log"} <= names and "site" not in names
    assert sorted(p.name for p in out.iterdir()) == ["lease.log", "lease.tgz"]


def test_a_lease_cuts_its_stages_to_its_own_deadline(tmp_path):
    """The call's limit kills whatever runs past it, packing included: each stage's limit is cut to what is left of
    the lease's deadline, and a stage with too little left is skipped, not started."""
    out, slow = tmp_path / "out", tmp_path / "slow.sh"
    slow.write_text("echo started; sleep 120\n")  # a stage that outlasts any limit, on any machine
    r = run("lease.sh", "--dry-run", OUT=str(out), STAGES="tests:300 loader:300", LEASE_DEADLINE_S="27",
            LEASE_WORK=str(tmp_path / "work"), GPU_CHECK=str(slow))
    log = (out / "lease.log").read_text()
    assert r.returncode == 124, log[-3000:]
    assert "started" in log and re.search(r"== tests: exit 124 after \d+ s \(limit 1[0-2] s", log), log[-3000:]
    assert re.search(r"== loader: skipped, -?\d+ s left of the lease", log), log[-3000:]


def test_a_lease_refuses_a_stage_without_its_limit(tmp_path):
    """Refused before it makes its work directory (TMPDIR here: nothing may be left outside the test's own)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = run("lease.sh", "--dry-run", timeout=60, OUT=str(tmp_path / "out"), STAGES="tests loader:60",
            TMPDIR=str(scratch))
    assert r.returncode == 2 and "not 'tests'" in r.stdout
    assert list(scratch.iterdir()) == []
