import contextlib

import pytest

from maskedit.launcher import TritonServer
from maskedit_client import EditClient


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def server(settings, tmp_path_factory):
    """One real tritonserver for the whole integration session, stopped by pid at the end."""
    d = tmp_path_factory.mktemp("triton")
    s = TritonServer(log_path=d / "tritonserver.log", env={
        "MASKEDIT_MODEL_DIR": str(settings.model_dir),
        "MASKEDIT_CACHE_MEM_DIR": str(d / "shm"), "MASKEDIT_CACHE_DISK_DIR": str(d / "disk"),
        # tests that need a request running for a while (100 steps, no cache: cancelling it mid-batch) must not be
        # refused by the 60 s default bound on a loaded CI host, where the step time measured after a flood
        # predicts more; the bound is tested with DEADLINE_MS (test_flood.py) and in tests/unit/maskedit
        "MASKEDIT_LATENCY_BOUND_S": "600"})
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    c = EditClient(server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="session")
def controlnets(settings):
    """The model's ControlNet library (what the servers read by default, at request time): written as ``make
    model`` writes it when the model directory has none."""
    from maskedit_common.controls import library_names

    if not library_names(settings.controlnets):
        from maskedit.build_model import build_controlnets

        build_controlnets(settings.model_dir)
    return settings.controlnets


@contextlib.contextmanager
def chaos_cluster(settings, tmp_path_factory, name: str, max_queue: int):
    """Two supervised instances and the router process (``maskedit_lab.reliability.topology``) for the chaos and
    overload cases. One request per denoise step: the denoise queue (``max_queue``), not pre-processing (the tiny
    model's bottleneck on a small CPU), limits a server. After shutdown nothing may be left: no process, region or
    port."""
    from maskedit_lab.reliability.topology import running_topology

    env = {"MASKEDIT_MODEL_DIR": str(settings.model_dir), "MASKEDIT_MAX_QUEUE": str(max_queue),
           "MASKEDIT_MAX_BATCH": "1", "MASKEDIT_CACHE_MEM_BYTES": str(64 << 20)}
    with running_topology(2, tmp_path_factory.mktemp(name), env) as t:
        yield t
    assert not any(t.leftovers().values()), t.leftovers()
