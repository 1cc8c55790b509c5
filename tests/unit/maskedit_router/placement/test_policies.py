"""Routing decisions, on the router's own bookkeeping (no server)."""

import time

import pytest

from maskedit_common.cost_model import CostModel
from maskedit_router.placement.features import EditFeatures, mask_ratio
from maskedit_router.placement.policies import (BackendLoad, Estimator, LeastMaskedTokens, LeastRequests,
                                                PredictedLatency, RoundRobin)
from tests.conftest import png

import numpy as np

EST = Estimator(CostModel.fallback())
F = EditFeatures("tplA", 0.2, 1024, 8)


def loads(*backlogs, templates=()):
    out = [BackendLoad(f"b{i}", backlog_ms=b, inflight=int(b // 100)) for i, b in enumerate(backlogs)]
    for i in templates:
        out[i].templates["tplA"] = time.monotonic() + 60
    return out


def test_cached_request_is_predicted_cheaper():
    assert EST.request_ms(F, cached=True) < EST.request_ms(F, cached=False) / 2


def test_affinity_wins_when_loads_are_close():
    bs = loads(300.0, 0.0, templates=[0])
    assert PredictedLatency(EST).choose(bs, F).name == "b0"


def test_load_wins_when_the_affine_backend_is_far_behind():
    bs = loads(60_000.0, 0.0, templates=[0])
    assert PredictedLatency(EST).choose(bs, F).name == "b1"


def test_hot_spot_guard_overrides_affinity():
    p = PredictedLatency(EST, abs_gate_ms=500, rel_gate=2.0)
    bs = loads(EST.request_ms(F, False) - EST.request_ms(F, True) - 1, 0.0, templates=[0])
    bs[0].backlog_ms = max(bs[0].backlog_ms, 900.0)
    chosen = p.choose(bs, F)
    assert chosen.name == "b1" or p.score(bs[0], F, time.monotonic()) < p.score(bs[1], F, time.monotonic())


def test_baselines():
    bs = loads(500.0, 100.0, 300.0)
    rr = RoundRobin()
    assert [rr.choose(bs, F).name for _ in range(4)] == ["b0", "b1", "b2", "b0"]
    assert LeastRequests().choose(bs, F).name == "b1"
    bs[1].masked_tokens = 5000
    assert LeastMaskedTokens().choose(bs, F).name in ("b0", "b2")


def test_estimator_refits_online():
    e = Estimator(CostModel.fallback())
    p = e.request_ms(F, True)
    for _ in range(50):
        e.observe(e.request_ms(F, True), 2 * p)
    assert e.request_ms(F, True) == pytest.approx(2 * p, rel=0.05)


def test_mask_ratio_from_the_encoded_mask():
    m = np.zeros((512, 512), np.uint8)
    m[:128, :] = 255  # a quarter of the rows
    ratio, tokens = mask_ratio(png(m), resolution=512)
    assert tokens == 1024 and ratio == pytest.approx(0.25)
    assert mask_ratio(png(np.zeros((64, 64), np.uint8)), 512)[0] == 0.0


def test_stale_cost_model_falls_back_to_least_masked_tokens():
    e = Estimator(CostModel.fallback())
    p = PredictedLatency(e)
    bs = [BackendLoad("b0", masked_tokens=5000, backlog_ms=0.0), BackendLoad("b1", masked_tokens=10, backlog_ms=9e5)]
    assert p.choose(bs, F).name == "b0"  # the model says b1 is far behind
    for _ in range(30):  # predictions keep being off by 10x
        e.observe(100.0, 1000.0, alpha=0.2)
        e.scale = 1.0  # (keep the fit from catching up, as with a model that no longer describes the backends)
    assert e.stale
    assert p.choose(bs, F).name == "b1"
    for _ in range(30):
        e.observe(1000.0, 1000.0, alpha=0.2)
    assert not e.stale and p.choose(bs, F).name == "b0"


def test_refit_of_a_burst_does_not_compound():
    """Twenty requests routed at scale 1 all take twice their prediction: the fit converges to 2, however many
    complete after it has already moved (the ratio is taken against the scale each was predicted with)."""
    e = Estimator(CostModel.fallback())
    p = e.request_ms(F, True)  # predicted at scale 1, before any completion
    for _ in range(20):
        e.observe(p, 2 * p, predicted_scale=1.0, alpha=0.3)
    assert e.scale == pytest.approx(2.0, rel=0.01)


def test_a_hit_is_never_predicted_dearer_than_a_miss_even_past_the_calibrated_sizes():
    """A profile whose full-block fit is one calibrated size (a constant) extrapolated the KV fit past it and
    predicted a hit at 4096 tokens above a miss: affinity then sent every repeat of a template elsewhere."""
    from maskedit_common.cost_model import LinearFit

    const, slope = LinearFit([16.0, 0.0, 0.0, 0.0], 1.0), LinearFit([1.0, 7.0, 0.0, 8.0], 1.0)
    est = Estimator(CostModel(compute={k: {"full": const, "kv": slope} for k in ("dual", "single")}))
    big = EditFeatures("tplA", 0.2, 4096, 2)
    assert est.request_ms(big, cached=True) <= est.request_ms(big, cached=False)
    bs = loads(0.0, 0.0, templates=[1])  # equal predictions: the backend holding the template keeps it
    assert PredictedLatency(est).choose(bs, big).name == "b1"


def test_the_routers_default_profile_predicts_a_hit_cheaper_on_its_own_token_grid():
    from maskedit_router.__main__ import build

    router = build(["10.0.0.1:8001"])
    assert router.resolution == router.est.cost.meta["resolution"]  # masks measured on the profiled grid
    ratio, n = mask_ratio(png(np.pad(np.full((51, 256), 255, np.uint8), ((0, 205), (0, 0)))), router.resolution)
    f = EditFeatures("tplA", ratio, n, 8)
    assert router.est.request_ms(f, cached=True) < 0.7 * router.est.request_ms(f, cached=False)
    for b in router.backends.values():
        b.close()


def test_a_profiles_blocks_set_what_the_estimator_sums():
    """A UNet's blocks per level (tokens relative to the router's 16-px grid, both guidance rows): the prediction
    sums each run's blocks at its own token count."""
    meta = {"blocks": [["unet-l1", 2, 512, 64], ["unet-l2", 4, 128, 128]], "grid_tokens": 256, "text": 154}
    est = Estimator(CostModel(meta=meta, fallback_flops_per_ms=2e7))
    assert est.blocks == [("unet-l1", 2, 2.0, 64), ("unet-l2", 4, 0.5, 128)] and est.text == 154
    f = EditFeatures("t", 0.25, 256, 1)
    want = 2 * est.cost.block_ms("unet-l1", "full", 512, 512, 154, 64) + \
        4 * est.cost.block_ms("unet-l2", "full", 128, 128, 154, 128)
    assert est.request_ms(f, cached=False) == pytest.approx(want)
    assert est.request_ms(f, cached=True) < want


def test_the_router_finds_the_served_models_profile_as_the_backends_do(tmp_path, monkeypatch):
    from maskedit_router.__main__ import default_profile

    monkeypatch.setenv("MASKEDIT_PROFILES_DIR", str(tmp_path))
    monkeypatch.setenv("MASKEDIT_MODEL_DIR", str(tmp_path / "models" / "my-model"))
    monkeypatch.delenv("MASKEDIT_COST_PROFILE", raising=False)
    assert default_profile().name == "cost_model_bench-flux-fill.json"  # nothing of its own: the shipped one
    (tmp_path / "cost_model_my-model.json").write_text("{}")
    assert default_profile() == tmp_path / "cost_model_my-model.json"
    (tmp_path / "cost_model_my-model_h100.json").write_text("{}")
    assert default_profile() == tmp_path / "cost_model_my-model_h100.json"  # a GPU's before the CPU's
    monkeypatch.setenv("MASKEDIT_COST_PROFILE", str(tmp_path / "x.json"))
    assert default_profile() == tmp_path / "x.json"


# -- the affinity-aware baselines and the predictor's residency (issue 31) ----------------------------------------
import collections
import math
import random

from maskedit_router.placement.policies import (POLICIES, Booking, ConsistentHashBoundedLoads, PowerOfTwoChoices,
                                                WeightedScorers, make, parse_weights)


def _f(key, ratio=0.2, steps=8, **kw):
    return EditFeatures(key, ratio, 1024, steps, **kw)


def test_chwbl_bound_is_respected_and_keys_stay_put():
    """No backend ever takes a request that puts it above ceil(c * (total + 1) / n); unloaded, a key always maps to
    the same backend; with a backend over the bound the key moves to the next one on the ring."""
    p = ConsistentHashBoundedLoads(load_factor=1.25, vnodes=100)
    bs = [BackendLoad(f"b{i}") for i in range(8)]
    rng = random.Random(0)
    for _ in range(2000):  # Zipf-like keys, random completions
        key = f"t{min(int(rng.paretovariate(1.1)), 50)}"
        total = sum(b.inflight for b in bs)
        bound = math.ceil(1.25 * (total + 1) / len(bs))
        chosen = p.choose(bs, _f(key))
        assert chosen.inflight + 1 <= bound
        chosen.inflight += 1
        if rng.random() < 0.5:
            busy = [b for b in bs if b.inflight]
            rng.choice(busy).inflight -= 1
    idle = [BackendLoad(f"b{i}") for i in range(8)]
    home = p.choose(idle, _f("tplA"))
    assert all(p.choose(idle, _f("tplA")) is home for _ in range(5))
    home.inflight = 10  # over the bound for the next request
    assert p.choose(idle, _f("tplA")) is not home
    # keys spread over the backends (virtual nodes)
    counts = collections.Counter(p.choose(idle, _f(f"k{i}")).name for i in range(4000))
    assert len(counts) == 7 and max(counts.values()) < 3 * min(counts.values())


def test_chwbl_load_factor_is_a_setting_and_must_be_at_least_one():
    assert make("chwbl", EST).load_factor == 1.25
    assert make("chwbl", EST, load_factor=2.0).load_factor == 2.0
    with pytest.raises(ValueError):
        ConsistentHashBoundedLoads(load_factor=0.9)


def test_p2c_samples_two_and_takes_the_one_with_less_outstanding_work():
    bs = [BackendLoad(f"b{i}", work=w) for i, w in enumerate((500, 100, 300, 900))]

    class Spy(random.Random):
        def sample(self, population, k):
            assert k == 2 and len(population) == 4
            got = super().sample(population, k)
            self.seen.append(got)
            return got

    p = PowerOfTwoChoices()
    p.rng = Spy(1)
    p.rng.seen = []
    for _ in range(50):
        c = p.choose(bs, F)
        a, b = p.rng.seen[-1]
        assert a is not b and c is min((a, b), key=lambda x: x.work)
    # outstanding work is masked tokens x steps, booked and released with each request
    load = BackendLoad("x")
    bk = Booking.add(load, EST, _f("t", 0.25, steps=30), 0.0, 60)
    assert load.work == 256 * 30 and bk.work == 256 * 30
    bk.remove(load, 1.0)
    assert load.work == 0


def test_weighted_scores_are_normalised():
    p = WeightedScorers()
    assert sum(p.weights.values()) == pytest.approx(1.0)
    assert p.weights["affinity"] == pytest.approx(3 / 9)
    bs = [BackendLoad(f"b{i}", inflight=q) for i, q in enumerate((0, 4, 8))]
    bs[2].templates["tplA"] = 1e12
    s = p.scores(bs, F, 0.0)
    assert all(0.0 <= x <= 1.0 for x in s)
    # every scorer in [0, 1]: the empty, least loaded backend scores queue 1, utilisation 1 (and adapter 1: the
    # request names none, so every backend holds all of them)
    assert s[0] == pytest.approx(p.weights["queue"] + p.weights["utilisation"] + p.weights["adapter"])
    # all equal queues: the queue scorer gives all 1, not a division by zero
    same = [BackendLoad(f"c{i}", inflight=3) for i in range(3)]
    assert WeightedScorers({"affinity": 0, "utilisation": 0, "adapter": 0}).scores(same, F, 0.0) == [1.0, 1.0, 1.0]
    # weights are settings
    assert WeightedScorers(parse_weights("affinity=1,queue=1,utilisation=0,adapter=0")).weights == {
        "affinity": 0.5, "queue": 0.5, "utilisation": 0.0, "adapter": 0.0}
    with pytest.raises(ValueError):
        WeightedScorers({"latency": 1.0})
    # affinity decides between equally loaded backends
    eq = [BackendLoad(f"d{i}", inflight=1) for i in range(3)]
    eq[1].templates["tplA"] = 1e12
    assert p.choose(eq, F, 0.0) is eq[1]


def test_every_policy_is_made_by_name():
    for name in POLICIES:
        assert make(name, EST).name == name
    with pytest.raises(ValueError):
        make("fastest", EST)


def test_shadow_store_tiers_and_their_cost():
    """The router's shadow of a backend's store: the memory tier evicts to the disk tier, a disk hit costs the
    profile's disk read, a miss the full model."""
    b = BackendLoad("b", mem_templates=2, disk_templates=2)
    for k in ("a", "b", "c"):
        b.touch(k, 1e9)
    assert (b.tier("c", 0), b.tier("a", 0), b.tier("zz", 0)) == ("mem", "disk", None)
    b.touch("d", 1e9)
    b.touch("e", 1e9)  # a, b fall to disk ... a falls off
    assert b.tier("a", 0) is None and b.tier("c", 0) == "disk"
    e = Estimator(CostModel.fallback())
    f = _f("c")
    assert e.cost_ms(f, b, 0) == pytest.approx(e.request_ms(f, True) + e.tier_load_ms("disk"))
    assert e.cost_ms(_f("d"), b, 0) == pytest.approx(e.request_ms(f, True))
    assert e.cost_ms(_f("zz"), b, 0) == pytest.approx(e.request_ms(f, False))


def test_checkpoint_residency_and_deadline_slack():
    e = Estimator(CostModel.fallback(), model_load_ms=5000.0, lora_load_ms=500.0)
    p = PredictedLatency(e)
    a, b = BackendLoad("a", model_slots=1), BackendLoad("b", model_slots=1)
    a.touch_model("M1")
    b.touch_model("M2")
    f = _f("t", model="M2", loras=2)
    assert e.model_ms(f, a) == 6000.0 and e.model_ms(f, b) == 0.0
    assert p.choose([a, b], f, 0.0) is b
    Booking.add(a, e, f, 0.0, 60)  # loads M2 on a, evicting M1 (one slot)
    assert a.holds_model("M2") and not a.holds_model("M1")
    # slack: with a deadline both meet, the backend where it costs the least work wins even if it finishes later
    c, d = BackendLoad("c"), BackendLoad("d")
    d.touch("t", 1e9)
    d.backlog_ms, d.drain_t = e.request_ms(_f("t"), False), 0.0  # d finishes it later (its backlog)
    late_but_cheap = _f("t", deadline_s=1e6)
    greedy = dict(congestion_weight=0.0, min_work_weight=0.0)  # latency alone: the extra work not charged
    assert PredictedLatency(e, use_slack=False, **greedy).choose([c, d], _f("t"), 0.0) is c
    slack = PredictedLatency(e, **greedy)
    assert slack.choose([c, d], late_but_cheap, 0.0) is d
    assert slack.choose([c, d], _f("t", deadline_s=0.001), 0.0) is c  # no slack: the earliest completion
    # the deadline counts with a margin: predicted to finish at 0.8 of it on d does not meet it at the default 0.6
    tight = _f("t", deadline_s=(d.backlog_at(0.0) + e.request_ms(_f("t"), True)) / 0.8 / 1000)
    assert PredictedLatency(e, deadline_margin=1.0, **greedy).choose([c, d], tight, 0.0) is d
    assert PredictedLatency(e, **greedy).choose([c, d], tight, 0.0) is c


def test_extra_work_is_charged_by_the_requests_it_delays():
    """A template run where a cached run would do costs (miss - hit) of capacity; charged x 2 per request in flight
    on the backend that would run it (at least x 1), so a busy backend keeps away and an idle one takes it."""
    e = Estimator(CostModel.fallback())
    hit, miss = e.request_ms(_f("t"), True), e.request_ms(_f("t"), False)
    c, d = BackendLoad("c"), BackendLoad("d")
    d.touch("t", 1e9)
    d.backlog_ms, d.drain_t, d.inflight = 1.5 * (miss - hit), 0.0, 1  # d holds t, a little behind
    p = PredictedLatency(e)
    assert p.choose([c, d], _f("t"), 0.0) is d  # c idle: 2 * miss - hit > 1.5 * (miss - hit) + hit
    assert PredictedLatency(e, min_work_weight=0.0, congestion_weight=0.0).choose([c, d], _f("t"), 0.0) is c
    d.backlog_ms = 3 * (miss - hit)  # far enough behind: load beats affinity
    assert p.choose([c, d], _f("t"), 0.0) is c
    c.inflight = 2  # but c is busy too: its extra work would delay its 2 requests (x 4)
    assert p.choose([c, d], _f("t"), 0.0) is d


def test_backlog_drains_while_the_backend_works():
    e = Estimator(CostModel.fallback())
    load = BackendLoad("b")
    bk = Booking.add(load, e, _f("t", steps=30), 10.0, 60)
    assert load.backlog_at(10.0) == pytest.approx(bk.predicted_ms)
    half = bk.predicted_ms / 2000.0
    assert load.backlog_at(10.0 + half) == pytest.approx(bk.predicted_ms / 2)
    assert load.backlog_at(10.0 + 10 * half) == 0.0
    bk.remove(load, 10.0 + 10 * half)
    assert load.backlog_ms == 0.0 and load.drained_ms == 0.0


def test_adapters_cost_a_cold_load_where_they_were_not_routed_and_policies_prefer_their_holders():
    """The router's shadow of each backend's adapters (``adapter_residency``): a request's adapters count as held
    where it was routed (until they expire or fall out of the LRU); each one a backend does not hold costs
    ``lora_load_ms``; ``predicted`` and ``weighted`` send a request to the backend holding its adapters."""
    e = Estimator(CostModel.fallback(), lora_load_ms=400.0)
    a, b = BackendLoad("a"), BackendLoad("b")
    f = _f("t", adapters=("style", "detail"), loras=2)
    assert e.adapter_ms(f, a, 0.0) == 800.0 and e.cost_ms(f, a, 0.0) == pytest.approx(e.request_ms(f, False) + 800)
    assert e.adapter_ms(_f("t"), a, 0.0) == 0.0
    Booking.add(b, e, _f("other", adapters=("style",)), 0.0, 60)  # b served "style" (another template)
    assert e.adapter_ms(f, b, 1.0) == 400.0 and b.adapters.share_held(f.adapters, 1.0) == 0.5
    assert e.adapter_ms(f, b, 61.0) == 800.0  # expired: cold again
    b.backlog_ms = 0.0
    assert PredictedLatency(e).choose([a, b], f, 1.0) is b
    a.inflight = 1  # as busy as b (its one request): the adapter term decides
    assert make("weighted", e).choose([a, b], f, 1.0) is b
    # without adapters: a (its store emptier) wins
    assert make("weighted", e).choose([a, b], _f("t2"), 1.0) is a
    # far busier, the holder loses: the saved load is smaller than the queue
    b.backlog_ms, b.drain_t = 5000.0, 1.0
    assert PredictedLatency(e).choose([a, b], f, 1.0) is a
    # the LRU keeps ``slots`` adapters; a failed backend's books are forgotten
    b.adapters.slots = 2
    b.adapters.touch(("x", "y"), 100.0)
    assert not b.adapters.holds("style", 1.0) and len(b.adapters) == 2
    b.forget()
    assert b.adapters.missing(("x", "y"), 1.0) == 2
    # a trace's unnamed adapters still load with their checkpoint
    e2 = Estimator(CostModel.fallback(), model_load_ms=5000.0, lora_load_ms=500.0)
    assert e2.model_ms(_f("t", model="M", loras=2), a) == 6000.0
    assert e2.model_ms(_f("t", model="M", loras=2, adapters=("p", "q")), a) == 5000.0
