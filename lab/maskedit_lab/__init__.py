"""The lab: baselines and benchmarks that measure the service, kept apart from the serving packages.

- ``stock``: what a user runs today — stock Diffusers ``FluxFillPipeline``, one request at a time — and its thin
  Triton model, the baseline of the serving benchmark.
- ``bench_serving``: the service against that baseline and its own scheduling baselines under open-loop load.
"""
