"""The lab cluster's backends keep their cancel markers and queue boards in the cluster's own RAM directory, removed
with it: the settings' defaults (/dev/shm/maskedit-$UID/...) were left behind after every run."""

from pathlib import Path

from maskedit_lab.harness import cluster


class Recorded:
    """What ``running_backends`` hands each server (the Triton launch itself is the integration tests')."""

    made: list = []

    def __init__(self, log_path, env, extra_args=None):
        self.env = env
        Recorded.made.append(self)

    def start(self):
        return self

    def stop(self):
        pass


def test_cancel_and_admission_directories_live_and_die_with_the_cluster(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "TritonServer", Recorded)
    for k in ("MASKEDIT_CANCEL_DIR", "MASKEDIT_ADMISSION_DIR"):
        monkeypatch.delenv(k, raising=False)
    Recorded.made = []
    with cluster.running_backends(2, tmp_path, supervise=False):
        envs = [s.env for s in Recorded.made]
        ram = Path(envs[0]["MASKEDIT_CACHE_MEM_DIR"]).parent
        for k in ("MASKEDIT_CANCEL_DIR", "MASKEDIT_ADMISSION_DIR"):
            assert {e[k] for e in envs} == {envs[0][k]} and Path(envs[0][k]).parent == ram  # shared, in the cluster's
        assert ram.is_dir()
    assert not ram.exists()


def test_a_directory_the_caller_sets_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "TritonServer", Recorded)
    monkeypatch.setenv("MASKEDIT_ADMISSION_DIR", str(tmp_path / "boards"))
    Recorded.made = []
    with cluster.running_backends(1, tmp_path, env={"MASKEDIT_CANCEL_DIR": str(tmp_path / "cancel")},
                                  supervise=False):
        (env,) = [s.env for s in Recorded.made]
        assert env["MASKEDIT_CANCEL_DIR"] == str(tmp_path / "cancel") and "MASKEDIT_ADMISSION_DIR" not in env
