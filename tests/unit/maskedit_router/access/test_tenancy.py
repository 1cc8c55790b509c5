"""The key file, the per-key limits and the fair queue: their rules alone (no server)."""

import os
import time

import pytest

from maskedit_router.access.auth import (ANONYMOUS, Forbidden, KeyFileError, Keyring, Tenant, Unauthenticated, bearer,
                                         parse)
from maskedit_router.access.tenancy import FairQueue, OverLimit, Quotas, TokenBucket

USER_KEY = "sk-user-0123456789abcdef"
ADMIN_KEY = "sk-admin-0123456789abcdef"
KEYS = f"""# key  tenant  role  limits
{USER_KEY}   acme   user   rps=2 burst=3 concurrent=2 weight=2
{ADMIN_KEY}  ops    admin  # no limits
"""


def test_a_key_file_gives_each_key_its_tenant_role_limits_and_weight():
    keys = {t.name: t for t in parse(KEYS).values()}
    assert keys["acme"].role == "user" and (keys["acme"].rps, keys["acme"].burst) == (2, 3)
    assert keys["acme"].concurrent == 2 and keys["acme"].weight == 2
    assert keys["ops"].admin and keys["ops"].rps == 0 and keys["ops"].weight == 1
    assert USER_KEY not in repr(keys["acme"])  # a tenant's repr (as logged) never holds its key


@pytest.mark.parametrize("line,why", [
    ("sk-short acme user", "16 to 512"),
    (f"{USER_KEY} acme root", "role 'root'"),
    (f"{USER_KEY} acme", "got 2 field"),
    (f"{USER_KEY} ac/me user", "tenant"),
    (f"{USER_KEY} acme user rps=fast", "rps='fast'"),
    (f"{USER_KEY} acme user weight=0", "weight=0"),
    (f"{USER_KEY} acme user speed=3", "'speed=3'"),
    (f"{USER_KEY} acme user burst=3", "burst without rps"),
])
def test_a_bad_line_is_an_error_naming_the_file_and_line_but_never_the_key(line, why):
    with pytest.raises(KeyFileError) as e:
        parse(f"# header\n\n{line}\n", "keys.txt")
    assert str(e.value).startswith("keys.txt line 3: ") and why in str(e.value)
    assert USER_KEY not in str(e.value)


def test_a_duplicate_key_names_both_lines():
    with pytest.raises(KeyFileError, match="line 2: the same key as line 1"):
        parse(f"{USER_KEY} a user\n{USER_KEY} b admin\n")


def test_the_router_refuses_to_start_on_a_bad_key_file_naming_the_line(tmp_path, capsys):
    from maskedit_router.__main__ import main

    f = tmp_path / "keys.txt"
    f.write_text(f"{USER_KEY} acme user\n{ADMIN_KEY} ops superuser\n")
    with pytest.raises(SystemExit):
        main(["--backends", "a:1", "--api-keys-file", str(f)])
    err = capsys.readouterr().err
    assert f"{f} line 2: role 'superuser'" in err and ADMIN_KEY not in err


def test_keys_are_checked_bearer_and_by_role(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text(KEYS)
    ring = Keyring(f)
    assert ring.check(f"Bearer {USER_KEY}").name == "acme"
    assert ring.check(f"bearer {ADMIN_KEY}", admin=True).name == "ops"
    with pytest.raises(Unauthenticated, match="no API key"):
        ring.check(None)
    with pytest.raises(Unauthenticated, match="invalid API key"):
        ring.check("Bearer sk-wrong-0123456789abcdef")
    with pytest.raises(Unauthenticated):
        ring.check(USER_KEY)  # not the Bearer scheme
    with pytest.raises(Forbidden, match="needs an admin key"):
        ring.check(f"Bearer {USER_KEY}", admin=True)
    assert bearer("Basic abc") is None and bearer("Bearer  k ") == "k"
    open_ring = Keyring(None)
    assert not open_ring.enabled and open_ring.check(None, admin=True) is ANONYMOUS
    assert "open mode" in open_ring.describe()


def test_a_changed_key_file_is_reloaded_and_a_bad_one_keeps_the_old_keys(tmp_path, caplog):
    f = tmp_path / "keys.txt"
    f.write_text(KEYS)
    ring = Keyring(f, poll_s=0.05).start()
    try:
        new = "sk-new-0123456789abcdef"
        f.write_text(f"{new} newco user\n")
        os.utime(f, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # a distinct mtime even on coarse clocks
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                ring.check(f"Bearer {new}")
                break
            except Unauthenticated:
                time.sleep(0.05)
        assert ring.check(f"Bearer {new}").name == "newco"
        with pytest.raises(Unauthenticated):
            ring.check(f"Bearer {USER_KEY}")  # gone with the old file
        f.write_text(f"{new} newco wizard\n")
        os.utime(f, ns=(time.time_ns() + 2 * 10**9, time.time_ns() + 2 * 10**9))
        assert not ring.reload_if_changed()
        assert ring.check(f"Bearer {new}").name == "newco"  # the old keys stay in force
        assert "line 1: role 'wizard'" in caplog.text and new not in caplog.text
    finally:
        ring.stop()


def test_the_token_bucket_allows_its_burst_then_its_rate_and_says_when():
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0, 0, 0]
    assert b.take(0.0) == pytest.approx(0.5)  # one token every 0.5 s
    assert b.take(0.5) == 0
    assert b.take(0.5) > 0 and b.take(10.0) == 0  # refills, up to its burst


def test_quotas_refuse_at_once_over_rate_or_concurrency_with_a_retry_hint():
    now = [0.0]
    q = Quotas(clock=lambda: now[0])
    t = Tenant("acme", rps=1, burst=2, concurrent=2, key_id="k1")
    q.enter(t)
    q.enter(t)
    with pytest.raises(OverLimit) as e:
        q.enter(t)
    assert e.value.reason == "concurrency" and "RESOURCE_EXHAUSTED" in str(e.value)
    q.leave(t)
    with pytest.raises(OverLimit) as e:  # a place is free, but no token: rate
        q.enter(t)
    assert e.value.reason == "rate" and e.value.retry_after_s == pytest.approx(1.0)
    assert "retry after 1.00 s" in str(e.value)
    now[0] = 1.0
    q.enter(t)
    other = Tenant("beta", rps=1, burst=1, key_id="k2")  # each key has its own bucket
    q.enter(other)
    q.enter(ANONYMOUS)  # no limits: never refused


def _granted_order(fair: bool) -> list[str]:
    """One slot busy; a flood tenant queues 6 requests, then two light tenants queue one each; the order the
    queue lets them through as the slot frees."""
    q = FairQueue(slots=1, max_wait_s=30, fair=fair)
    order = []
    flood, a, b = Tenant("flood", key_id="f"), Tenant("a", key_id="a"), Tenant("b", weight=2, key_id="b")
    q.request(flood, lambda: order.append("first"), lambda m: None)
    for _ in range(6):
        q.request(flood, lambda: order.append("flood"), lambda m: None)
    q.request(a, lambda: order.append("a"), lambda m: None)
    q.request(b, lambda: order.append("b"), lambda m: None)
    for _ in range(8):
        q.release()
    q.stop()
    return order


def test_the_fair_queue_lets_light_tenants_past_a_flood_and_fifo_does_not():
    fair = _granted_order(True)
    assert fair[0] == "first" and set(fair[1:4]) >= {"a", "b"}  # right behind the first of the flood's queue
    assert len(fair) == 9  # all of them, in the end
    fifo = _granted_order(False)
    assert fifo == ["first"] + ["flood"] * 6 + ["a", "b"]  # behind the whole flood


def test_weights_share_the_slots_in_proportion():
    q = FairQueue(slots=1, max_wait_s=30)
    order = []
    heavy, light = Tenant("heavy", weight=3, key_id="h"), Tenant("light", weight=1, key_id="l")
    q.request(light, lambda: None, lambda m: None)  # holds the slot
    for _ in range(12):
        q.request(heavy, lambda: order.append("heavy"), lambda m: None)
        q.request(light, lambda: order.append("light"), lambda m: None)
    for _ in range(12):
        q.release()
    q.stop()
    assert 8 <= order[:12].count("heavy") <= 10  # 3 : 1 (the light one's first request counts too)


def test_a_request_that_waits_too_long_is_refused_never_lost():
    q = FairQueue(slots=1, max_wait_s=0.1)
    got = []
    q.request(ANONYMOUS, lambda: got.append("granted"), got.append)
    q.request(ANONYMOUS, lambda: got.append("late grant"), got.append)
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    q.stop()
    assert got[0] == "granted" and got[1].startswith("RESOURCE_EXHAUSTED: waited") and "fair queue" in got[1]
    assert q.waiting() == 0


def test_what_the_router_forwards_names_the_keys_tenant_and_weight_over_the_clients_claim():
    from tritonclient.grpc import service_pb2

    from maskedit.fair_share import TENANT_PARAM as BACKEND_TENANT, WEIGHT_PARAM as BACKEND_WEIGHT
    from maskedit_router.access.tenancy import TENANT_PARAM, WEIGHT_PARAM, tag_request

    assert (TENANT_PARAM, WEIGHT_PARAM) == (BACKEND_TENANT, BACKEND_WEIGHT)  # the two sides agree
    acme = next(t for t in parse(KEYS).values() if t.name == "acme")
    req = service_pb2.ModelInferRequest()
    req.parameters[TENANT_PARAM].string_param = "ops"  # a claim
    req.parameters[WEIGHT_PARAM].double_param = 99.0
    req.parameters["x-maskedit-tenant"].string_param = "vip"  # the picker's header names, which the backend reads
    req.parameters["x-maskedit-tenant-weight"].string_param = "100"  # first: a client's claim under them goes
    tag_request(req, acme)
    assert (req.parameters[TENANT_PARAM].string_param, req.parameters[WEIGHT_PARAM].double_param) == ("acme", 2.0)
    assert sorted(req.parameters) == [TENANT_PARAM, WEIGHT_PARAM]
    assert USER_KEY not in str(req)  # never the key
    open_mode = service_pb2.ModelInferRequest()
    tag_request(open_mode, ANONYMOUS)  # no key file: nothing known of the caller, nothing added
    assert not open_mode.parameters


def test_a_refusal_says_when_the_slots_are_held_because_no_backend_is_up():
    """With every backend down, the slot holders wait out the router's retry budget and everyone else is refused by
    the fair queue: the refusal names the real cause, not only a busy queue."""
    from maskedit_router.__main__ import NO_BACKEND_HOLDS_SLOTS

    up = [True]
    q = FairQueue(slots=1, max_wait_s=0.05, why_busy=lambda: "" if up[0] else NO_BACKEND_HOLDS_SLOTS)
    got = []
    q.request(ANONYMOUS, lambda: got.append("granted"), got.append)
    for state in (True, False):
        up[0] = state
        n = len(got)
        q.request(ANONYMOUS, lambda: got.append("late grant"), got.append)
        deadline = time.monotonic() + 5
        while len(got) == n and time.monotonic() < deadline:
            time.sleep(0.01)
    q.stop()
    busy, down = got[1], got[2]
    assert busy.startswith("RESOURCE_EXHAUSTED: waited") and "no backend is healthy" not in busy
    assert "1 of 1 backend slots busy; no backend is healthy" in down and down.endswith("retry after 1 s")
