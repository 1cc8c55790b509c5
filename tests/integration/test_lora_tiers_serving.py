"""The adapter cache's tiers through the served ensemble (the shared server): pre-processing prefetches a request's
adapters into the host tier, denoise loads them (from the host tier or the library file), and both processes export
their adapter metrics on the metrics port."""

import re
import time
import urllib.request

import pytest

from maskedit import samples
from tests.conftest import png


def _metrics(server) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()


def _sum(text: str, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (a value may be a regex)."""
    total = 0.0
    for body, value in re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', body))
        if all(re.fullmatch(v, have.get(k, "")) for k, v in labels.items()):
            total += float(value)
    return total


def test_adapters_are_prefetched_into_the_host_tier_and_measured(client, server):
    s = server.settings
    if not (s.adapters / "attn-mlp-r8").is_dir():
        pytest.skip("no adapter library beside the model (`make model` writes it)")
    tpl, mask = samples.template(128, 128, seed=4), samples.mask(128, 128, 0.3, "box", seed=4)
    r = client.edit(png(tpl), png(mask), "a hat", steps=2, loras=[("attn-mlp-r8", 0.6)])
    assert r.png and "adapters_from_step" not in r.info  # the exact path: early start is off by default
    host = s.lora_host_cache_dir
    assert any(p.name.startswith("attn-mlp-r8--") for p in host.glob("*.safetensors")), list(host.iterdir())
    text = _metrics(server)
    # denoise: its adapter load (from the host tier, or the file when it got there before the prefetch) is timed
    assert _sum(text, "maskedit_lora_load_seconds_count", source="host|library") >= 1
    assert _sum(text, "maskedit_lora_cache_total", tier="device", event="miss") >= 1
    assert _sum(text, "maskedit_lora_resident_bytes", tier="device") > 0
    deadline = time.time() + 3 * s.service.metrics_sync_s + 5  # pre-processing's metrics refresh on a timer
    while _sum(text, "maskedit_lora_prefetch_cache_total", tier="host", event="hit|miss") < 1:
        assert time.time() < deadline, "pre-processing exported no prefetch"
        time.sleep(0.5)
        text = _metrics(server)
    assert _sum(text, "maskedit_lora_prefetch_resident_bytes", tier="host") > 0
