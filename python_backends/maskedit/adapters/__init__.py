"""LoRA adapters served per request, without touching the base weights.

- ``library``: the configured adapter directory (``Settings.adapters``): names to files (requests carry names,
  never paths; nothing outside the directory is opened), file digests for the activation-cache key.
- ``convert``: an adapter file to per-module low-rank factors, through Diffusers' own loaders (the stock
  pipeline's ``lora_state_dict`` with the family's converters, ``convert_unet_state_dict_to_peft`` and
  ``_create_lora_config`` for ranks and alphas): the same factors and scalings ``load_lora_weights`` gives PEFT.
- ``delta``: unmerged low-rank deltas, ``x·Aᵀ·Bᵀ·scale`` added to each targeted projection's output through a
  Diffusers hook on the projection (``HookRegistry``), grouped by adapter over the rows of a batch (Punica /
  S-LoRA style): requests with different adapter sets, and with none, share one denoiser call; the families'
  mask-aware (cached) block paths add them too (``owners``: which request each row is; ``add_fused``).
- ``merge``: the merged (fused) path for a call whose requests all carry one adapter set: ``W + Σ (B@A)·scale``
  as new tensors per set (the base weights are only read), chosen per projection by a cost model with measured
  throughputs.
- ``runtime``: the device tier of the adapter cache (one denoiser's converted adapters by name and digest, LRU
  within a byte budget) and where a load looks next: ``host_cache`` (converted adapters in safetensors files on a
  RAM filesystem shared by the host's processes, checksummed, LRU) then the library file;
- ``jobs`` and ``loader``: requests' adapters loaded on background threads while the request waits in the queue
  (or, under early start, starts without them); ``prefetch``: pre-processing fills the host tier ahead of denoise,
  converting on a weightless ``skeleton`` of the denoiser; ``stats``: what the tiers did, for the metrics.
- ``build``: seeded random adapters for the tiny presets, in Diffusers and kohya formats.

What is family-specific (the loader's keyword arguments, where the denoiser's keys start) is asked of the model
family (``ModelFamily.lora_*``); nothing here imports a family.
"""
