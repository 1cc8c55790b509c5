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
