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
