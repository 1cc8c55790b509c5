"""The step loop of the family-level temporal-reuse tests: jobs (the families' test stand-ins) admitted with their
policies and stepped together as the runner drives them (``ModelRunner.prepare`` / ``step``)."""

import torch

from maskedit import temporal


def denoise_with_reuse(family, run_, jobs: list, policies: list) -> list:
    """Give ``jobs`` their ``policies`` (None: no reuse), admit them and step them together to the end."""
    run_.family = family
    for j, policy in zip(jobs, policies):
        j.inputs.temporal, j.temporal = policy, None
        family.prepare_job(run_, j)
        temporal.admit(run_, j)
    with torch.no_grad():
        while jobs[0].step_index < jobs[0].steps:
            ctx = temporal.attach(None, jobs, lambda: family.temporal_hooks(run_.transformer))
            family.step(run_, jobs, ctx)
            temporal.commit(ctx, jobs)
    return jobs


def cached_with_reuse(family, run_, runtime, jobs: list, policies: list, key: str, register: bool = False) -> list:
    """``jobs`` on cache key ``key`` through the cache ``runtime`` and with their temporal ``policies``, stepped
    together as the runner drives them (the loader told which rows a reusing hit skips)."""
    run_.family = family
    hooks = lambda: family.temporal_hooks(run_.transformer)  # noqa: E731
    for j, p in zip(jobs, policies):
        j.inputs.cache_key, j.inputs.register, j.inputs.temporal, j.temporal = key, register, p, None
        family.prepare_job(run_, j)
        runtime.admit(j)
        temporal.admit(run_, j)
    with torch.no_grad():
        while jobs[0].step_index < jobs[0].steps:
            ctx = temporal.attach(runtime.context(jobs, temporal.loads(jobs, hooks())), jobs, hooks)
            family.step(run_, jobs, ctx)
            temporal.commit(ctx, jobs)
            runtime.after_step(jobs)
    for j in jobs:
        runtime.finish(j, True)
    runtime.flush()
    return jobs


def check_no_reuse_is_plain(run_, steps: int) -> None:
    """Threshold 0 computes every step and equals the plain path bit for bit (``run_(policies)`` -> results)."""
    (plain,) = run_([None])
    (zero,) = run_([{"policy": "fbcache", "threshold": 0}])
    assert zero.temporal.info()["temporal_steps"] == "C" * steps
    assert torch.equal(zero.latents, plain.latents)


def check_mixed_call_equals_each_alone(run_, policy: dict, computed: str) -> None:
    """A plain and a reusing request (``policy``, its steps ``computed``) in one call equal each alone."""
    (plain,) = run_([None])
    (alone,) = run_([policy])
    assert alone.temporal.info()["temporal_steps"] == computed
    assert not torch.equal(alone.latents, plain.latents)
    both = run_([None, policy])
    torch.testing.assert_close(both[0].latents, plain.latents, atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1].latents, alone.latents, atol=1e-5, rtol=0)


def check_a_hit_reuses(cached, policy: dict, computed: str):
    """``cached(policies, register=False)`` runs jobs on one cache key: a template run registers the entry, then a hit
    without reuse, one at threshold 0 and one with ``policy`` (its steps ``computed``). Threshold 0 equals the plain
    hit bit for bit, the reusing hit changes the result, and a plain and a reusing hit in one call equal each alone.
    Returns (the plain hit, the reusing hit) for the family's own checks of the rows they computed."""
    cached([policy], register=True)
    (hit,), (zero,), (reused,) = cached([None]), cached([{"policy": "fbcache", "threshold": 0}]), cached([policy])
    assert hit.cache.status == reused.cache.status == "hit"
    assert torch.equal(zero.latents, hit.latents)
    assert reused.temporal.info()["temporal_steps"] == computed and not torch.equal(reused.latents, hit.latents)
    both = cached([None, policy])
    torch.testing.assert_close(both[0].latents, hit.latents, atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1].latents, reused.latents, atol=1e-5, rtol=0)
    return hit, reused
