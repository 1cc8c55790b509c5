"""The committed model repository is the CPU rendering of maskedit.repository; GPU renders without edits."""

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
    pre, den, dec = repository.models()[:3]
    assert {t.name for t in den.inputs} == {t.name for t in pre.outputs}
    assert {t.name for t in dec.inputs} == {t.name for t in den.outputs}
    assert {t.name for t in pre.inputs} == {t.name for t in repository.EDIT_INPUTS}
    assert {t.name for t in dec.outputs} == {t.name for t in repository.EDIT_OUTPUTS}
    assert den.decoupled and not pre.decoupled and not dec.decoupled


def test_preprocess_refuses_in_front_of_its_work_when_its_queue_is_full():
    """Triton's queue policy on the ensemble's first step (a bound, no timeout: Triton's timeout refusal names no
    request id); the other stages keep Triton's default queue."""
    text = repository.render("cpu")["preprocess/config.pbtxt"]
    assert f"max_queue_size: {repository.PREPROCESS_QUEUE.max_size}" in text and "timeout" not in text
    assert "max_batch_size: 0" in text  # no batching: the block holds the policy only
    assert all("default_queue_policy" not in t for rel, t in repository.render("cpu").items()
               if not rel.startswith("preprocess/"))
