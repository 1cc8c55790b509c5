"""Mask-aware activation caching (InstGenIE section 3 and 4.2).

- ``store``: the host-memory activation store shared by the Triton model processes, with a disk tier.
- ``key``: what a cache entry is valid for.
- ``decision``: what the cache does for a request (off / record / hit / full), decided once before admission.
- ``policy``: which mode each block of a hit runs in; ``planner``: Algorithm 1, the dynamic program it uses.
- ``cost_model``: profiled latencies the planner predicts with (``maskedit_common.cost_model``, shared with the
  router) and the hardware name a profile is stored under.
- ``flux``: the masked computation of Flux blocks, attached to Diffusers' blocks as hooks; the ``Recorder``.
- ``live``: template runs in progress, which later requests on the same template follow.
- ``loader``: cached rows to the device block by block, ahead of compute (a copy stream on a GPU).
- ``writer``: finished template runs and heals written into the store in the background.
- ``heal``: when a hit rewrites its entry with the template context it computed (the pure rules are
  ``maskedit_common.heal``, which the router's simulator applies too).
- ``runtime``: the facade an engine uses, and the per-request ``JobCache``.
"""
