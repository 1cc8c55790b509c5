"""FLUX.1 Kontext's mask-aware block hooks: FLUX.1's (``maskedit.cache.flux``, this is its transformer class), over
an image stream of the N noisy tokens then the R reference tokens. The reference rows are cached like unmasked
tokens' (``reference_tokens``; docs/caching.md "Reference rows"): entries of N + R rows per block, a hit computes
the text and its masked noisy tokens only."""

from __future__ import annotations

from ...cache.flux import FluxCacheHooks


class KontextCacheHooks(FluxCacheHooks):
    def reference_tokens(self, x) -> int:
        """The reference image's tokens, or the template's N when the request names no reference image."""
        extra = getattr(x, "reference", None)
        return int(x.latents.shape[0] if extra is None else extra.shape[0])
