"""The committed model repository is the CPU rendering of maskedit.repository; GPU renders without edits."""

import subprocess
import sys
from pathlib import Path

from maskedit import repository


def test_committed_configs_match_the_description():
    for rel, text in repository.render("cpu").items():
        path = repository.REPOSITORY / rel
        assert path.read_text() == text, f"{rel} is stale: run `python -m maskedit.repository`"


def test_every_python_model_has_a_shim():
    for m in repository.models():
        shim = repository.REPOSITORY / m.name / "1" / "model.py"
        assert "TritonPythonModel" in shim.read_text()
    assert (repository.REPOSITORY / "edit" / "1").is_dir()


def test_gpu_rendering(tmp_path: Path):
    repository.write(tmp_path / "repo", "gpu")
    for m in repository.models():
        text = (tmp_path / "repo" / m.name / "config.pbtxt").read_text()
        assert "kind: KIND_GPU" in text and "KIND_CPU" not in text
        assert (tmp_path / "repo" / m.name / "1" / "model.py").exists()
    assert 'platform: "ensemble"' in (tmp_path / "repo" / "edit" / "config.pbtxt").read_text()


def test_ensemble_wiring_is_closed():
    """Every stage input is fed by an ensemble input or an earlier stage's output (decoupled rule included:
    vae_decode reads only what masked_denoise produced)."""
    intake, pre, den, dec = repository.models()[:4]
    assert {t.name for t in intake.inputs} <= {t.name for t in repository.EDIT_INPUTS}
    assert {t.name for t in den.inputs} == {t.name for t in pre.outputs}
    assert {t.name for t in dec.inputs} == {t.name for t in den.outputs}
    assert {t.name for t in pre.inputs} == {t.name for t in repository.EDIT_INPUTS} | {t.name for t in intake.outputs}
    assert {t.name for t in dec.outputs} == {t.name for t in repository.EDIT_OUTPUTS}
    assert den.decoupled and not pre.decoupled and not dec.decoupled and not intake.decoupled


def test_no_model_has_a_batcher(tmp_path: Path):
    """No ``dynamic_batching`` block anywhere: in Triton 2.51 its batcher thread paces a model with a queue policy
    0.5 s apart (docs/reliability.md); the default scheduler hands a queued request to a waiting instance at once."""
    repository.write(tmp_path / "gpu", "gpu")
    for kind, texts in (("cpu", repository.render("cpu")), ("gpu", {
            rel: (tmp_path / "gpu" / rel).read_text() for rel in repository.render("gpu")})):
        for rel, text in texts.items():
            assert "dynamic_batching" not in text and "queue_policy" not in text, (kind, rel)


def test_intake_is_the_first_step():
    """The ensemble's first step is the light ``intake`` (one instance, PROMPT only: no images copied into it), and
    pre-processing's INTAKE_INFO comes from it (optional: a direct call to ``preprocess`` still works)."""
    text = repository.render("cpu")["edit/config.pbtxt"]
    steps = text[text.index("ensemble_scheduling"):].split("model_name: ")[1:]
    assert [s.split('"')[1] for s in steps] == ["intake", "preprocess", "masked_denoise", "vae_decode"]
    assert 'output_map { key: "INTAKE_INFO" value: "_intake_info" }' in steps[0]
    assert 'input_map { key: "INTAKE_INFO" value: "_intake_info" }' in steps[1]
    intake = next(m for m in repository.models() if m.name == "intake")
    assert [t.name for t in intake.inputs] == ["PROMPT"] and intake.instances == 1
    pre = next(m for m in repository.models() if m.name == "preprocess")
    assert next(t for t in pre.inputs if t.name == "INTAKE_INFO").optional


def test_intake_imports_no_torch():
    """Intake's stub stays light (~330 MiB, like ``cancel``): what its shim imports (``maskedit.triton.io`` aside,
    which needs the stub's ``triton_python_backend_utils`` and imports torch only to limit threads) pulls in no
    torch."""
    code = ("import sys, maskedit.intake, maskedit.logs, maskedit.settings, maskedit.fair_share; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out
