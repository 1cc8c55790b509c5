"""Temporal reuse (step-to-step caching) per request, inside the continuously batched step loop.

Mask-aware caching removes the work on unmasked tokens; temporal reuse removes the work of the middle blocks on
steps where they would change little: the first ``fn`` blocks always run, and on a *reused* step the blocks after
them up to the last ``bn`` are skipped, their residual from the request's last computed step (or a TaylorSeer
forecast of it) added instead. The policies (``maskedit_common.temporal``) are cache-dit's DBCache with its step
mask and TaylorSeer calibrator, which cover Diffusers' ``FirstBlockCache``.

What is the libraries' and what is ours:
- the decision rules (warm-up, step mask, cached-step limits, the relative L1 residual change under a threshold)
  are cache-dit's ``CachedContextManager.can_cache`` / ``similarity`` and Diffusers' ``FBCHeadBlockHook``, written
  out here per request (``state``): those libraries keep one state per module, i.e. one request per forward;
- the TaylorSeer forecast is cache-dit's own ``TaylorSeerState`` (one per request, call and image / text stream);
- ours: state per request in a batch whose members sit at different steps (``state.TemporalState``), the per-call
  controller the block hooks consult (``call.TemporalCall``: which rows skip which blocks, capturing and applying
  residuals row by row), a second state per request for the negative prompt's call of true classifier-free guidance
  (``TemporalState.uncond``, its call run with ``negative``'s context: the stock pipelines' "uncond" cache context,
  cache-dit's ``enable_separate_cfg``), and its composition with the mask-aware path (a hit's residuals over its
  computed tokens, its unmasked rows from the activation entry), packed resolutions, adapters and ControlNets.

Tests check a request alone against the stock pipeline with Diffusers' / cache-dit's hooks, threshold 0 against no
reuse bit for bit, mixed batches against each request alone (``tests/unit/maskedit/test_temporal.py``).
"""

from .call import TemporalCall, attach, commit, loads
from .state import COND, UNCOND, TemporalState, admit

__all__ = ["COND", "UNCOND", "TemporalCall", "TemporalState", "admit", "attach", "commit", "loads"]
