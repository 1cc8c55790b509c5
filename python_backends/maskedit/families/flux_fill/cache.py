"""Flux Fill's mask-aware block hooks: those of Diffusers' ``FluxTransformer2DModel`` blocks, shared with every family
whose denoiser is one (``maskedit.cache.flux``; ``flux_controlnet`` runs the same transformer class)."""

from ...cache.flux import (HOOK_NAME, FluxCacheHooks, MaskedBlockHook, _FusedInputs, _inputs, image_kv,  # noqa: F401
                           masked_block)
