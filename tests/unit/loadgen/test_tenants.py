"""Replaying the trace's groupId as tenants: each request knows its tenant, each tenant gets a key, and the key file
written for them is one the router reads."""

from collections import Counter

from loadgen.workload import gentd26_arrivals, gentd26_groups, tenant_keys, write_key_file
from maskedit_router.access.auth import Keyring


def test_groups_align_with_arrivals_and_become_keys_the_router_accepts(tmp_path):
    t, steps = gentd26_arrivals(limit=500, start=100)
    groups = gentd26_groups(limit=500, start=100)
    assert len(groups) == len(t) == 500
    busiest = Counter(groups).most_common(1)[0][1]
    assert 1 < busiest < 500  # many tenants, some busier than others
    keys = tenant_keys(groups)
    assert keys == tenant_keys(groups) and len(set(keys.values())) == len(keys)
    f = tmp_path / "keys.txt"
    write_key_file(f, keys)
    ring = Keyring(f)
    g = groups[0]
    assert ring.check(f"Bearer {keys[g]}").name.replace("-", "") != ""
    assert len({t.name for t in ring.tenants()}) == len(keys)


def test_the_fairness_run_sends_the_flood_at_3x_and_each_light_tenant_at_a_tenth_and_names_who_refused():
    from loadgen import tenants

    reqs = tenants.mix(2.0, 100.0, steps=4, flood=True)
    count = {t: sum(r.tenant == t for r in reqs) for t in (*tenants.LIGHT, tenants.FLOOD)}
    assert count[tenants.FLOOD] == 600 and all(count[t] == 20 for t in tenants.LIGHT)
    assert [r.t for r in reqs] == sorted(r.t for r in reqs)
    assert not any(r.tenant == tenants.FLOOD for r in tenants.mix(2.0, 100.0, steps=4, flood=False))
    assert tenants.refused_by("RESOURCE_EXHAUSTED: waited 5.00 s in the router's fair queue") == "router_fair_queue"
    assert tenants.refused_by("denoise queue is full (8 waiting) and tenant 'flood' holds more than its fair "
                              "share of it") == "backend_displaced"
    assert tenants.refused_by("RESOURCE_EXHAUSTED: denoise queue is full (8 waiting)") == "backend"


def test_thirty_requests_per_light_tenant_set_the_phase_and_every_tenant_is_held_to_its_own_p95_alone():
    from loadgen import tenants

    cap = 1.33
    duration = 30 / (tenants.LIGHT_SHARE * cap)  # what --light-requests 30 makes a phase last
    reqs = tenants.mix(cap, duration, steps=4, flood=True)
    assert all(sum(r.tenant == t for r in reqs) == 30 for t in tenants.LIGHT)
    row = lambda t, ratio, lost=0: {"tenant": t, "layers": "router+backend", "ratio": ratio,  # noqa: E731
                                    "sent": 30, "lost": lost}
    good = [row(t, 1.2) for t in tenants.LIGHT] + [row("light (all)", 1.1)]
    assert tenants.targets(good)["each_light_tenant_p95_within_1.5x_alone"]
    # the pool within 1.5x hides one tenant at 1.8x: the per-tenant target does not
    one_bad = [row(t, 1.8 if t == "light3" else 1.0) for t in tenants.LIGHT] + [row("light (all)", 1.1)]
    t = tenants.targets(one_bad)
    assert t["light_p95_within_1.5x_alone_with_fair_share"] and not t["each_light_tenant_p95_within_1.5x_alone"]
    assert t["worst_light_tenant_ratio"] == 1.8 and t["light_requests_per_tenant"] == 30
    assert not tenants.targets(good + [{**row("flood", None), "lost": 1}])["nothing_lost"]
