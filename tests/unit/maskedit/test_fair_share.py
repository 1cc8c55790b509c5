"""Fair share of a backend's denoise queue between tenants: weights respected, first come first served within a
tenant, a late light tenant served next however long the flood's queue, a full queue bounded (the flood gives way,
refused, never lost), the admission board letting the lighter tenant through, the tenant read from the request."""

import threading
from types import SimpleNamespace

import pytest

from maskedit.admission import QueueBoard
from maskedit.denoise import DenoiseJob
from maskedit.engine import DenoiseEngine
from maskedit.errors import InvalidInput, ResourceExhausted
from maskedit.fair_share import FairShare, tenant_of
from maskedit.scheduler import BatchScheduler


def job(tenant, t, weight=1.0):
    return SimpleNamespace(tenant=tenant, weight=weight, fair_tag=0.0, submitted_at=t, tokens=1, steps=1,
                           step_index=0, deadline=None, idle_steps=0)


def served(fair, waiting, n):
    """The tenants the scheduler admits, one per step (``max_batch`` 1), for ``n`` steps."""
    sched, order = BatchScheduler("continuous", max_batch=1), []
    for _ in range(n):
        chosen, _ = sched.admit(waiting, [])
        waiting.remove(chosen[0])
        fair.started(chosen[0], waiting)
        order.append(chosen[0])
    return order


def test_weights_are_respected_and_each_tenant_is_served_in_arrival_order():
    fair, waiting = FairShare(), []
    for i in range(12):  # both backlogged, "b" with twice the weight
        for j in (job("a", 2 * i), job("b", 2 * i + 1, weight=2.0)):
            fair.tag(j)
            waiting.append(j)
    order = served(fair, waiting, 12)
    assert [j.tenant for j in order].count("b") == 8  # 2 : 1 of the slots
    for t in ("a", "b"):
        times = [j.submitted_at for j in order if j.tenant == t]
        assert times == sorted(times)  # FIFO within a tenant


def test_a_light_tenant_is_served_next_behind_a_flood_and_one_tenant_alone_is_fifo():
    fair, waiting = FairShare(), []
    for i in range(50):
        waiting.append(job("flood", i))
        fair.tag(waiting[-1])
    served(fair, waiting, 5)
    light = job("light", 100)
    fair.tag(light)
    waiting.append(light)
    assert served(fair, waiting, 1)[0] is light  # not after the 45 flood requests ahead of it
    rest = served(fair, waiting, len(waiting))
    assert [j.submitted_at for j in rest] == sorted(j.submitted_at for j in rest)
    off, waiting = FairShare(enabled=False), [job("flood", i) for i in range(5)] + [job("light", 9)]
    assert served(off, waiting, 6)[-1].tenant == "light"  # fair share off: first come, first served


def test_a_full_queue_gives_the_heaviest_tenants_newest_place_to_a_lighter_tenant_only():
    fair, waiting = FairShare(), []
    for i in range(4):
        waiting.append(job("flood", i))
        fair.tag(waiting[-1])
    assert fair.make_room(waiting, job("light", 9)) is waiting[-1]  # the flood's newest gives way
    with pytest.raises(ResourceExhausted, match="denoise queue is full"):
        fair.make_room(waiting, job("flood", 10))  # the flood itself: refused
    waiting = [job("a", 0), job("a", 1), job("b", 2), job("b", 3)]
    with pytest.raises(ResourceExhausted):
        fair.make_room(waiting, job("b", 4))  # would hold 3 to a's 2: refused, no churn between equals
    with pytest.raises(ResourceExhausted):
        fair.make_room(waiting, job("c", 4, weight=0.5))  # weight 0.5: one request is a share of 2, a's and b's
    assert fair.make_room(waiting, job("c", 4)).submitted_at in (1, 3)  # weight 1: an equal's newest gives way
    with pytest.raises(ResourceExhausted):
        FairShare(enabled=False).make_room([job("flood", i) for i in range(4)], job("light", 9))


def test_tags_forget_tenants_behind_the_virtual_time_and_past_a_bound_those_with_nothing_waiting():
    fair, waiting = FairShare(max_tenants=10), []
    for i in range(100):
        waiting.append(job(f"t{i}", i))
        fair.tag(waiting[-1])
    served(fair, waiting, 100)
    assert len(fair._finish) <= 10
    fair, waiting = FairShare(), [job("a", 0), job("a", 1), job("b", 2)]
    for j in waiting:
        fair.tag(j)
    served(fair, waiting, 3)  # b's tag (1) is behind the virtual time once a's second (start 1) runs
    assert set(fair._finish) == {"a"}


def test_in_the_engine_a_light_request_displaces_the_floods_newest_and_goes_first(runner, make_inputs):
    inputs = make_inputs(2)
    gate, finished, errors = threading.Event(), [], {}
    engine = DenoiseEngine(runner, max_batch=1, max_queue=3, fair=FairShare())
    done = threading.Semaphore(0)

    def submit(name, tenant, **kw):
        engine.submit(DenoiseJob(inputs, tenant=tenant, on_done=lambda j: (finished.append(name), done.release()),
                                 on_error=lambda j, e: (errors.setdefault(name, e), done.release()), **kw))

    submit("blocker", "flood", is_cancelled=lambda: not gate.wait(30) and False)
    for _ in range(500):  # the blocker holds the loop
        if engine.stats()["running"] == 1:
            break
        threading.Event().wait(0.01)
    for i in range(3):
        submit(f"flood{i}", "flood")
    with pytest.raises(ResourceExhausted):
        submit("flood3", "flood")
    submit("light", "light")
    assert isinstance(errors.get("flood2"), ResourceExhausted) and "fair share" in str(errors["flood2"])
    gate.set()
    for _ in range(5):  # four edits and the displaced one's refusal
        assert done.acquire(timeout=60)
    engine.shutdown()
    assert finished == ["blocker", "light", "flood0", "flood1"]


def test_the_board_lets_a_lighter_tenant_through_a_full_queue(tmp_path):
    denoise, pre = QueueBoard(tmp_path / "b"), QueueBoard(tmp_path / "b")
    denoise.publish(waiting=4, max_queue=4, shares={"flood": 3.0, "light": 1.0})
    with pytest.raises(ResourceExhausted):
        pre.check("flood")
    pre.check("other")  # holds nothing: denoise will give it the flood's newest place
    pre.check("light", weight=2.0)  # 1 + 1/2 < 3
    with pytest.raises(ResourceExhausted):
        pre.check("light", weight=0.4)  # 1 + 2.5 >= 3
    denoise.publish(waiting=4, max_queue=4)  # fair share off: full is full
    with pytest.raises(ResourceExhausted):
        pre.check("other")


def test_the_tenant_is_read_from_the_request_parameters():
    assert tenant_of('{"maskedit_tenant": "acme", "maskedit_tenant_weight": 2}') == ("acme", 2.0)
    assert tenant_of("{}") == ("", 1.0)  # a direct client: the unnamed tenant
    with pytest.raises(InvalidInput, match="maskedit_tenant: must be a tenant name"):
        tenant_of({"maskedit_tenant": "a b"})
    with pytest.raises(InvalidInput, match="maskedit_tenant_weight: must be a number from 0.01 to 100"):
        tenant_of({"maskedit_tenant_weight": 0})
