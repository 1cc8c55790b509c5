"""The lab: baselines, benchmarks, calibration, validation, simulators and dev tools that measure or drive the
service, kept apart from the serving packages (it may import all of them; none of them imports it).

Rooms by subject, each importing only those below it (``.importlinter``; docs/architecture.md):

- ``engine``: what measures the engine in one process — ``bench_engine`` (mask-aware caching against full
  computation), ``calibrate`` (the cost-model profile the planner and the router use), ``bench_temporal``,
  ``strength_cache``, ``kernel_ceiling`` and ``unet_costs`` (what stock kernels allow), ``engine_drift`` (a rerun
  against the committed figures), ``qwen_encoder_cost``;
- ``addons``: LoRA adapters and ControlNets against the base edit and stock Diffusers — ``bench_addons``,
  ``bench_controlnet*``, ``lora_load`` (the router's cold-load constant), ``lora_early_start``, ``lora_base_reuse``;
- ``serving``: the served system under load — ``bench_serving`` against ``stock`` (stock Diffusers as a thin Triton
  model, what a user of the Triton tutorials runs), ``bench_batching`` (static vs continuous batching);
- ``routing``: the router beyond this machine — ``sim`` over ``sim_cluster``'s simulated workers, ``validate``
  (the simulator against real instances, ``validate_replay`` its replay), ``scale`` (the real router in front of
  ``triton_emulator``'s emulated instances, beside ``direct_baseline``: the same requests sent straight to them);
- ``reliability``: the service under faults and past its capacity, judged by what every request ended in —
  ``chaos``, ``faults``, ``fault_streams``, ``overload``, ``soak``, ``tenant_fairness`` over ``topology`` (supervised
  instances and the router as its own process), with ``capacity``, ``full_strength``, ``footprint`` and ``report``;
- ``harness``: what the others share — ``in_process`` (a model, store and template in one process),
  ``baselines`` (composed from the serving classes), ``edit_quality``, and ``cluster`` (N local Triton instances
  behind the router, ``make serve INSTANCES=N``) with its ``supervisor``. The cluster starts both sides, so it sits
  here, above both: the router package is only the service that is deployed, and imports nothing of the backend.

The serving, routing and reliability rooms drive the load generator (``loadgen``: workload, runner, records), which
imports nothing of the lab.

The lab runs from a source checkout: its results go under ``REPO_ROOT`` (``perf_profiles/results``, ``out/``).
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
