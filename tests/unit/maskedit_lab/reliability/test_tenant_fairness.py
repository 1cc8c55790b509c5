"""``make bench-tenants``: the mix of a flood and light tenants, who refused, and the per-tenant targets."""

from maskedit_lab.reliability import tenant_fairness as fairness


def test_the_fairness_run_sends_the_flood_at_3x_and_each_light_tenant_at_a_tenth_and_names_who_refused():
    reqs = fairness.mix(2.0, 100.0, steps=4, flood=True)
    count = {t: sum(r.tenant == t for r in reqs) for t in (*fairness.LIGHT, fairness.FLOOD)}
    assert count[fairness.FLOOD] == 600 and all(count[t] == 20 for t in fairness.LIGHT)
    assert [r.t for r in reqs] == sorted(r.t for r in reqs)
    assert not any(r.tenant == fairness.FLOOD for r in fairness.mix(2.0, 100.0, steps=4, flood=False))
    assert fairness.refused_by("RESOURCE_EXHAUSTED: waited 5.00 s in the router's fair queue") == "router_fair_queue"
    assert fairness.refused_by("denoise queue is full (8 waiting) and tenant 'flood' holds more than its fair "
                               "share of it") == "backend_displaced"
    assert fairness.refused_by("RESOURCE_EXHAUSTED: denoise queue is full (8 waiting)") == "backend"


def test_thirty_requests_per_light_tenant_set_the_phase_and_every_tenant_is_held_to_its_own_p95_alone():
    cap = 1.33
    duration = 30 / (fairness.LIGHT_SHARE * cap)  # what --light-requests 30 makes a phase last
    reqs = fairness.mix(cap, duration, steps=4, flood=True)
    assert all(sum(r.tenant == t for r in reqs) == 30 for t in fairness.LIGHT)
    row = lambda t, ratio, lost=0: {"tenant": t, "layers": "router+backend", "ratio": ratio,  # noqa: E731
                                    "sent": 30, "lost": lost}
    good = [row(t, 1.2) for t in fairness.LIGHT] + [row("light (all)", 1.1)]
    assert fairness.targets(good)["each_light_tenant_p95_within_1.5x_alone"]
    # the pool within 1.5x hides one tenant at 1.8x: the per-tenant target does not
    one_bad = [row(t, 1.8 if t == "light3" else 1.0) for t in fairness.LIGHT] + [row("light (all)", 1.1)]
    t = fairness.targets(one_bad)
    assert t["light_p95_within_1.5x_alone_with_fair_share"] and not t["each_light_tenant_p95_within_1.5x_alone"]
    assert t["worst_light_tenant_ratio"] == 1.8 and t["light_requests_per_tenant"] == 30
    assert not fairness.targets(good + [{**row("flood", None), "lost": 1}])["nothing_lost"]
