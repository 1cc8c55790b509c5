"""Shared helpers of the family cache tests: a cache runtime per policy over one real store, and a job denoised
through a runtime as the engine drives it."""

from contextlib import contextmanager

import torch

from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit_lab.harness.baselines import cache_policy


@contextmanager
def policy_runtimes(hooks, d):
    """``rt(policy)``: one ``CacheRuntime`` per cache policy (made on first use) over one store under ``d``; all
    closed on exit."""
    store = ActivationStore(d / "mem", d / "disk", 1 << 30, 1 << 30)
    runtimes = {}

    def rt(policy):
        if policy not in runtimes:
            runtimes[policy] = CacheRuntime(hooks, store, policy=cache_policy(policy))
        return runtimes[policy]

    try:
        yield rt
    finally:
        for r in runtimes.values():
            r.close()


def run_cached(family, run_, runtime, j):
    """``j`` denoised by runner ``run_`` with ``runtime`` deciding, loading and recording, as the engine drives it."""
    family.prepare_job(run_, j)
    runtime.admit(j)
    with torch.no_grad():
        while j.step_index < j.steps:
            family.step(run_, [j], runtime.context([j]))
            runtime.after_step([j])
    runtime.finish(j, True)
    runtime.flush()
    return j.latents
