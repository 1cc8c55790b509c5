"""What the activation cache does for a request, decided once, before it is admitted (as vLLM's KV-cache manager
is consulted inside scheduling): the scheduler's token budget counts the tokens it will really compute, and
admission carries the decision out.

- ``off``: no caching (disabled, no key, or a template run of the key is in progress in another shape);
- ``record``: a template run (a miss, or ``REGISTER``): the full model, its rows recorded into a new entry;
- ``hit``: compute the request's masked tokens plus the entry's invalid ones, take the rest from the entry (a
  stored one, or a template run in progress here: the request follows it);
- ``full``: the entry exists but every token must be computed anyway.

A request with LoRA adapters has its own key (the adapter set is part of it): rows recorded under one set are never
used under another. With ``lora_base_reuse`` (opt-in, approximate) such a request whose own entry does not exist
but whose template is cached without adapters is a hit on that base entry (``base``): its unmasked rows lack its
adapters' effect; it neither records nor heals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .heal import computed_tokens, heal_candidates
from .live import LiveEntry, LiveRuns
from .store import ActivationStore, Entry

log = logging.getLogger(__name__)


@dataclass
class CacheDecision:
    status: str  # off | record | hit | full
    key: str | None = None
    entry: Entry | LiveEntry | None = None  # a hit's (or full's) rows
    computed: np.ndarray | None = None  # a hit: per image token, computed by this request
    heal: np.ndarray | None = None  # a hit from the store: invalid tokens it leaves unmasked (template context)
    base: bool = False  # an adapter request's hit on the entry recorded without adapters (``lora_base_reuse``)

    @property
    def follows(self) -> bool:
        return isinstance(self.entry, LiveEntry)

    def tokens(self, n: int) -> int:
        """Image tokens computed per step."""
        return max(1, int(self.computed.sum())) if self.status == "hit" else n


def fits(meta: dict, n: int, steps: int, dim: int, blocks: int, first_step: int = 0) -> bool:
    """Was the entry recorded for this request's shape (tokens, steps) and this model (width, depth), from its
    first step or earlier? (A STRENGTH < 1 edit runs the schedule's last steps: an entry recorded from an earlier
    step of the same schedule holds rows at each of its timesteps, ``first_step`` in ``docs/caching.md``.)"""
    return meta.get("tokens") == n and meta.get("steps") == steps and meta.get("dim") == dim and \
        meta.get("blocks") == blocks and meta.get("first_step", 0) <= first_step


def latent_grid(x, n: int) -> tuple[int, int]:
    """A UNet request's latent grid (h, w): one token per latent pixel."""
    ppt = x.model_h * x.model_w // n  # pixels per token: 64 (8 x 8)
    side = int(round(ppt ** 0.5))
    return x.model_h // side, x.model_w // side


def _entry(key: str, x, store: ActivationStore, live_runs: LiveRuns, dim: int, blocks: int, count: bool, n: int):
    """The stored entry of ``key`` that fits ``x`` (``n`` tokens), else a template run of it in progress here, else
    None."""
    first = getattr(x, "first_step", 0)
    entry = store.open(key, count=count)
    if entry is not None and not fits(entry.meta, n, x.steps, dim, blocks, first):
        if fits(entry.meta, n, x.steps, dim, blocks, entry.meta.get("first_step", 0)):
            log.info("activation entry %s starts at step %s, after this request's %s: recording from it", key,
                     entry.meta.get("first_step"), first)
        else:
            log.warning("activation entry %s does not fit this request (tokens/steps/dim); ignoring it", key)
        entry = None
    if entry is None:
        live = live_runs.get(key)
        if live is not None and fits(live.meta, n, x.steps, dim, blocks, first):
            entry = live
    return entry


def decide(x, store: ActivationStore | None, live_runs: LiveRuns, dim: int, blocks: int,
           record: bool = True, count: bool = True, coarsest: int = 0, base_reuse: bool = False,
           mask: np.ndarray | None = None) -> CacheDecision:
    """The decision for ``x`` (``DenoiseInputs``). Reads the store and the runs in progress; changes nothing but
    the store's hit/miss counts (``count=False``: a second look for the same request). ``coarsest``: a UNet's
    deepest level with transformer blocks (what a hit may heal depends on it), 0 for Flux. ``base_reuse``: an
    adapter request without an entry of its own may use its template's entry recorded without adapters. ``mask``:
    per token the entry holds rows of, edited by this request? (``BlockHooks.cache_mask``: the image tokens and any
    reference tokens; default ``x.token_mask``)."""
    key = x.cache_key
    if store is None or not key:
        return CacheDecision("off")
    own = np.asarray(x.token_mask if mask is None else mask, bool)
    n = own.size
    if x.register:
        return CacheDecision("record" if record else "off", key)
    entry = _entry(key, x, store, live_runs, dim, blocks, count, n)
    base = False
    if entry is None and base_reuse and getattr(x, "base_cache_key", None):
        entry = _entry(x.base_cache_key, x, store, live_runs, dim, blocks, count, n)
        base = entry is not None
        if base:
            key = x.base_cache_key
    if entry is None:
        return CacheDecision("record" if record else "off", key)
    invalid = ~np.asarray(entry.arrays["valid"], dtype=bool)
    computed = computed_tokens(own, invalid)
    if computed.all():
        return CacheDecision("full", x.cache_key if base else key, None if base else entry)
    return CacheDecision("hit", key, entry, computed=computed, base=base,
                         heal=None if isinstance(entry, LiveEntry) or base else  # never heal a base entry
                         heal_candidates(own, invalid, latent_grid(x, x.latents.shape[0]) if coarsest else None,
                                         coarsest))
