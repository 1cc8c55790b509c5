"""Mask-aware activation caching (InstGenIE section 3 and 4.2).

- ``store``: the host-memory activation store shared by the Triton model processes, with a disk tier.
- ``key``: what a cache entry is valid for.
- ``planner``: Algorithm 1 — which blocks use the cache so loads hide behind compute.
- ``cost_model``: profiled latencies the planner (and the router) predict with.
- ``flux``: the masked computation of Flux blocks, attached to Diffusers' blocks as hooks.
- ``loader``: the background thread that brings cached rows in while earlier blocks compute.
"""
