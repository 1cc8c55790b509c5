"""Temporal reuse through the served ensemble (the session's shared server): TEMPORAL from the client reaches the
denoise loop, EDIT_INFO says which steps reused their middle blocks, Prometheus counts them, and a bad value fails
its request alone naming TEMPORAL while its stream-mate finishes."""

import re
import urllib.request

import numpy as np
import pytest

from maskedit import samples
from maskedit_client import EditError

STEP_MASK = {"policy": "steps", "steps": [0, 1, 3]}


def test_a_step_mask_is_carried_out_reported_and_counted(client, server):
    tpl, m = samples.template(256, 256, seed=41), samples.mask(256, 256, 0.2, "box", seed=41)
    plain = client.edit(tpl, m, "a green hat", seed=2, steps=5, use_cache=False)
    reused = client.edit(tpl, m, "a green hat", seed=2, steps=5, use_cache=False, temporal=STEP_MASK)
    assert "temporal_steps" not in plain.info
    assert reused.info["temporal_steps"] == "CCRCR" and reused.info["temporal_reused_steps"] == 2
    assert reused.info["temporal"] == {"policy": "steps", "steps": [0, 1, 3], "fn": 1, "bn": 0, "order": 0}
    assert 0 < reused.info["temporal_computed_fraction"] < 1
    assert reused.png != plain.png
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    got = re.search(r'maskedit_temporal_steps_total\{[^}]*outcome="reused"[^}]*\} (\d+)', text)
    assert got and int(got.group(1)) >= 2
    assert re.search(r'maskedit_temporal_blocks_total\{[^}]*outcome="skipped"[^}]*\} \d+', text)


def test_a_bad_policy_fails_alone_naming_the_field(client):
    tpl, m = samples.template(256, 256, seed=42), samples.mask(256, 256, 0.2, "box", seed=42)
    bad = client.submit(tpl, m, "x", steps=3, temporal='{"policy": "fbcache", "threshold": -1}')
    good = client.submit(tpl, m, "x", steps=3, temporal={"policy": "fbcache", "threshold": 0.2})
    with pytest.raises(EditError) as e:
        bad.result(timeout=120)
    assert e.value.code == "INVALID_ARGUMENT" and "TEMPORAL" in str(e.value) and "threshold" in str(e.value)
    assert np.asarray(good.result(timeout=300).image).shape == (256, 256, 3)
