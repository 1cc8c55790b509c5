"""The chaos suite's fast cases against real Triton instances, the supervisor and the router process: nothing is
lost under a fault, and nothing is left behind (``make chaos`` runs every fault, longer; overload:
``test_overload.py``)."""


import pytest

from maskedit_client import EditClient
from maskedit_lab.reliability import chaos

from .conftest import chaos_cluster

# Room in the denoise queue (the default is 64) for what a fault piles up: the clients' retried requests after a
# router restart arrive together, the survivor of a hung server takes all the load, a stopped router forwards what
# waited. With queues of 2 (shared with the overload cases once) a loaded 2-core host (a request takes 1-2 s) had
# them full by that alone, and these cases got RESOURCE_EXHAUSTED for capacity, not for the fault.
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def topo(settings, tmp_path_factory):
    with chaos_cluster(settings, tmp_path_factory, "chaos", MAX_QUEUE) as t:
        yield t


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


def test_with_keys_on_a_router_restart_under_load_loses_nothing_and_a_keyless_client_is_refused(topo):
    """The chaos checks hold with keys on (``make chaos ARGS=--api-keys`` runs every fault so): the router restarted
    with its key file under keyed load loses nothing, and a caller without a key is refused, not served."""
    from maskedit_client import EditError

    with topo.keys_on():
        case = chaos.run_case(topo, "restart_router", rate=1.0, duration_s=10, seed=7, progress=False)
        with EditClient(topo.url, retry=False, timeout_s=30) as c:
            with pytest.raises(EditError) as e:
                c.edit(*_images(), "a hat", steps=1)
    assert e.value.code == "UNAUTHENTICATED", str(e.value)
    assert case["lost"] == 0 and case["ok"] > 0, case
    assert set(case["failed_by_code"]) <= {"UNAVAILABLE"}, case
    assert case["recovered_after_restart_s"] is not None and case["recovered_after_restart_s"] <= 30, case


def _images():
    from maskedit import samples

    return samples.template(256, 256, seed=1), samples.mask(256, 256, 0.2, "box", seed=1)


def test_a_hung_server_loses_nothing_and_is_taken_back_after_it_resumes(topo):
    """SIGSTOP for 10 s, then SIGCONT: a hang, not a crash. The router takes it out of rotation (its requests
    retried or failed), and back only after a probe request succeeds once it resumes; the supervisor leaves it."""
    restarts = sum(i.recoveries for i in topo.supervisor.instances)
    case = chaos.run_case(topo, "sigstop_server", rate=2.0, duration_s=10, seed=6, progress=False)
    assert case["lost"] == 0 and case["ok"] > 0, case
    assert set(case["failed_by_code"]) <= {"UNAVAILABLE"}, case
    assert case["recovered_after_restart_s"] is not None and case["recovered_after_restart_s"] <= 30, case
    assert sum(i.recoveries for i in topo.supervisor.instances) == restarts  # not restarted: it was not dead


def test_a_dead_denoise_stub_is_reloaded_alone_under_load_and_taken_back(topo):
    """kill -9 of a masked_denoise stub under load (Triton 2.51 keeps saying ready, answering its requests with an
    error): the supervisor reloads that model alone through Triton's model-control API (the server keeps its pid
    and its other models), the router retries what the dead stub had, and takes the backend back once a probe
    request succeeds on it."""
    pids = [s.proc.pid for s in topo.servers]
    reloads = sum(i.total_reloads for i in topo.supervisor.instances)
    case = chaos.run_case(topo, "kill_denoise_stub", rate=2.0, duration_s=12, seed=8, progress=False)
    assert case["lost"] == 0 and case["ok"] > 0, case
    assert set(case["failed_by_code"]) <= {"UNAVAILABLE"}, case
    assert case["fault_detail"]["how"] == "reload", case["fault_detail"]
    assert sum(i.total_reloads for i in topo.supervisor.instances) == reloads + 1
    assert [s.proc.pid for s in topo.servers] == pids  # no server restarted
    assert case["recovered_after_restart_s"] is not None and case["recovered_after_restart_s"] <= 30, case
    assert not any(case["leftovers"].values()), case["leftovers"]


def test_a_stopped_router_costs_its_clients_only_the_wait(topo):
    """SIGSTOP of the router process under load, then SIGCONT: the requests that piled up meanwhile are served, none
    refused or failed, and no backend leaves rotation for the silence the stall made (a resumed router once probed
    both behind the burst and answered "no healthy backend"); the router counts the stall."""
    import threading
    import urllib.request

    out_of_rotation, stop = [], threading.Event()

    def watch():
        while not stop.wait(0.25):
            h = topo.health()  # None while the router is stopped
            out_of_rotation.extend(b["addr"] for b in (h or {}).get("backends", []) if not b["in_rotation"])

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        # 6 s: longer than the probe interval (5 s), and what piles up meanwhile (~12 requests) fits the two
        # backends' queues of 8 here (more would be refused for capacity: `make faults` stops it 30 s, queues of 64)
        case = chaos.run_case(topo, "sigstop_router", rate=2.0, duration_s=14, seed=9, progress=False,
                              faults={"sigstop_router": lambda t, r: chaos.sigstop_router(t, r, hang_s=6.0)})
    finally:
        stop.set()
        th.join(5)
    assert case["lost"] == 0 and case["ok"] == case["sent"], case  # nothing refused, nothing failed
    assert not out_of_rotation, out_of_rotation
    text = urllib.request.urlopen(f"http://127.0.0.1:{topo.http_port}/metrics", timeout=5).read().decode()
    assert "maskedit_router_stalls_total 1.0" in text or "maskedit_router_stalls_total 2.0" in text, \
        [line for line in text.splitlines() if "stall" in line]
