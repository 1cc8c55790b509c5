"""The chaos suite's fast cases against real Triton instances, the supervisor and the router process: nothing is
lost under a fault or under overload, and nothing is left behind (``make chaos`` runs every fault, longer)."""

import time

import pytest

from loadgen import chaos
from loadgen.topology import running_topology
from maskedit import samples
from maskedit_client import EditClient, EditError

MAX_QUEUE = 2


@pytest.fixture(scope="module")
def topo(settings, tmp_path_factory):
    # One request per denoise step and a short queue: the denoise queue, not pre-processing (the tiny model's
    # bottleneck on a small CPU), limits the server, so a burst meets the queue-full refusal.
    env = {"MASKEDIT_MODEL_DIR": str(settings.model_dir), "MASKEDIT_MAX_QUEUE": str(MAX_QUEUE),
           "MASKEDIT_MAX_BATCH": "1", "MASKEDIT_CACHE_MEM_BYTES": str(64 << 20)}
    with running_topology(2, tmp_path_factory.mktemp("chaos"), env) as t:
        yield t
    assert not any(t.leftovers().values()), t.leftovers()  # after shutdown: no process, region or port left


@pytest.mark.parametrize("through", ["server", "router"])
def test_overload_refusals_reach_their_own_stream_within_a_second(topo, through):
    """A burst far past the denoise queue on one stream: every request ends, the refused ones with
    RESOURCE_EXHAUSTED on their own future within a second of their send, none hangs."""
    url = topo.servers[0].grpc_url if through == "server" else topo.url
    tpl = samples.template(256, 256, seed=91)
    n = 16 if through == "server" else 24  # per backend: 1 denoising, 4 queued, a few pre-processing; the rest refused
    ended: dict[int, tuple[str, float]] = {}
    with EditClient(url) as c:
        futs = []
        for i in range(n):
            t = time.perf_counter()
            f = c.submit(tpl, samples.mask(256, 256, 0.2, "blob", seed=i), "a hat", seed=i, steps=100,
                         use_cache=False)  # long denoising: the denoise queue, not pre-processing, is the bottleneck
            f.add_done_callback(lambda f, i=i, t=t: ended.__setitem__(
                i, ("OK" if f.exception() is None else f.exception().code, time.perf_counter() - t)))
            futs.append(f)
        for f in futs:
            try:
                f.result(120)
            except EditError:
                pass
    assert len(ended) == n  # every request ended: a result or an error
    codes = [c for c, _ in ended.values()]
    refused = [s for c, s in ended.values() if c == "RESOURCE_EXHAUSTED"]
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert refused and codes.count("OK") >= MAX_QUEUE + 1, codes
    assert max(refused) < 1.0, sorted(ended.values())


def test_a_server_killed_under_load_loses_nothing_is_restarted_and_taken_back(topo):
    case = chaos.run_case(topo, "kill_server", rate=2.0, duration_s=12, seed=3, progress=False)
    assert case["lost"] == 0 and case["ok"] > 0, case
    assert set(case["failed_by_code"]) <= {"UNAVAILABLE"}, case
    assert case["time_to_recover_s"] is not None and case["recovered_after_restart_s"] <= 30, case
    assert not any(case["leftovers"].values()), case["leftovers"]  # the killed generation left nothing


def test_a_router_restart_under_load_loses_nothing(topo):
    case = chaos.run_case(topo, "restart_router", rate=2.0, duration_s=10, seed=4, progress=False)
    assert case["lost"] == 0 and case["ok"] > 0, case
    assert set(case["failed_by_code"]) <= {"UNAVAILABLE"}, case
    assert case["recovered_after_restart_s"] is not None and case["recovered_after_restart_s"] <= 30, case
