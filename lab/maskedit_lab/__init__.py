"""The lab: baselines, benchmarks, calibration, validation, simulators and dev tools that measure or drive the
service, kept apart from the serving packages (it may import all of them; none of them imports it).

- ``baselines``: the benchmarks' baselines, composed from the serving classes (fixed cache policies, the inline
  row loader, one transformer call per resolution, pre/post-processing on the loop thread);
- ``harness``: an in-process model, store and template for ``calibrate`` (the cost-model profile),
  ``bench_engine`` and ``bench_batching``; ``kernel_ceiling``: what stock kernels alone reach;
- ``stock``: what a user runs today — stock Diffusers ``FluxFillPipeline``, one request at a time — and its thin
  Triton model, the baseline of the serving benchmark; ``bench_serving``: the service against that baseline and
  its own scheduling baselines under open-loop load;
- ``router_sim``: the routing policies on the production trace at scale, over ``router_sim_cluster``'s simulated
  workers (the engine's own heal rules, ``maskedit_common.heal``); ``router_validate``: the simulator checked against
  real instances, ``router_validate_replay`` its replay of a measured run;
- ``cluster``: N local Triton instances (the backend's launcher) behind the router, ``make serve INSTANCES=N``;
  ``supervisor``: restarts an instance that dies. They start both sides, so they sit above both, here: the router
  package is only the service that is deployed, and imports nothing of the backend.

The lab runs from a source checkout: its results go under ``REPO_ROOT`` (``perf_profiles/results``, ``out/``).
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
