"""Predicted milliseconds of a request on a backend, from the engine's cost-model profile: its denoising at its mask
ratio and steps (cached blocks or the full model), bringing its template's entry in from the store's tier, and
loading its base checkpoint (and LoRAs) when not resident; refitted online from observed latencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from maskedit_common.cost_model import CostModel
from maskedit_common.temporal import computed_fraction

from .books import DISK, BackendLoad
from .features import EditFeatures

# A cold LoRA adapter load (read, Diffusers' conversion, hooks attached) in ms: measured by
# ``python -m maskedit_lab.addons.lora_load`` (perf_profiles/results/lora_load.json); the router's ``--lora-load-ms``.
LORA_LOAD_MS = 22.0  # bench-flux-fill, attn-mlp-r16 (3.8 MB), 2-core CPU float32: 22.5 ms


@dataclass
class Estimator:
    """Predicted denoise milliseconds of one request from the cost model (the engine's profile)."""

    cost: CostModel
    dual: int = 4
    single: int = 8
    dim: int = 256
    text: int = 64
    default_steps: int = 8
    scale: float = 1.0  # refitted online: observed / predicted
    # Recent |ln(observed / predicted)| (EMA; symmetric in over- and under-prediction). Beyond ``stale_error``
    # (default: typically off by more than 4x) the model no longer describes the backends (new hardware, a profile
    # of another model) and policies fall back to a score without it.
    error: float = 0.0
    stale_error: float = math.log(4.0)
    observations: int = 0
    entry_bytes: int = 300_000_000  # an activation-store entry of the served model (a template's)
    model_load_ms: float = 0.0  # loading a base checkpoint that is not resident (0: one model, always resident)
    lora_load_ms: float = 0.0  # loading one LoRA adapter the backend does not hold (cold: from disk)
    # Temporal reuse: per adaptive policy (``TemporalSpec.label``), the fraction of block evaluations its requests
    # computed (EMA of EDIT_INFO's ``temporal_computed_fraction``: a guided request's counts both of its calls); a
    # policy not seen yet is assumed to reuse nothing. A step mask's fraction is known from the request itself.
    temporal_fractions: dict = None

    def __post_init__(self):
        # The served model's blocks as its profile recorded them: runs of [kind, count, tokens, width], the tokens
        # relative to the image tokens of the router's grid, so any model family (Flux's blocks all at the image's
        # tokens, a UNet's per level with both guidance rows) is predicted without importing it. A profile
        # without them: ``dual`` + ``single`` Flux blocks of width ``dim`` at the image's tokens.
        meta = self.cost.meta
        self.reference = 0.0  # an in-context edit model's reference tokens per image token: never masked
        if meta.get("blocks") and meta.get("grid_tokens"):
            self.blocks = [(str(k), int(cnt), tokens / meta["grid_tokens"], int(d)) for k, cnt, tokens, d in
                           meta["blocks"]]
            self.text = int(meta.get("text", self.text))
            self.reference = meta.get("reference_tokens", 0) / meta["grid_tokens"]
        else:
            self.blocks = [("dual", self.dual, 1.0, self.dim), ("single", self.single, 1.0, self.dim)]
        self._memo: dict = {}
        self.temporal_fractions = dict(self.temporal_fractions or {})

    @property
    def n_blocks(self) -> int:
        return sum(count for _, count, _, _ in self.blocks)

    def computed_fraction(self, f: EditFeatures) -> float:
        """The fraction of its block evaluations ``f`` is expected to compute under its temporal reuse policy."""
        spec = f.temporal
        if spec is None or not spec.on:
            return 1.0
        steps = f.steps or self.default_steps
        if spec.static:
            return computed_fraction(spec, steps, self.n_blocks)
        return self.temporal_fractions.get(spec.label(), 1.0)

    def observe_temporal(self, spec, fraction: float, alpha: float = 0.2) -> None:
        """A request under adaptive policy ``spec`` computed ``fraction`` of its block evaluations."""
        if spec is None or not spec.on or spec.static or not 0.0 < fraction <= 1.0:
            return
        label = spec.label()
        prev = self.temporal_fractions.get(label)
        self.temporal_fractions[label] = fraction if prev is None else prev + alpha * (fraction - prev)

    def request_ms(self, f: EditFeatures, cached: bool) -> float:
        """Its denoising: the steps it runs (STRENGTH: ~strength x steps) at its tokens (PADDING_MASK_CROP: the crop's
        grid, ``features.mask_tokens``), at its temporal policy's computed fraction."""
        steps = f.run_steps if f.steps is not None else max(1, int(round(self.default_steps * f.strength)))
        return self.scale * self._unscaled_ms(f.mask_ratio, f.tokens, steps, cached) * self.computed_fraction(f)

    def _unscaled_ms(self, ratio: float, tokens: int, steps: int, cached: bool) -> float:
        key = (round(ratio, 4), tokens, steps, cached)
        got = self._memo.get(key)
        if got is not None:
            return got
        per_step = 0.0
        for kind, count, share, dim in self.blocks:
            n = max(1, int(round(share * tokens)))
            # (a UNet's coarser levels see a mask a little dilated; the online refit absorbs that)
            c = max(1, int(round(ratio * (n - self.reference * tokens))))
            full = self.cost.block_ms(kind, "full", n, n, self.text, dim)
            # The engine's planner never runs a block from the cache slower than computing it in full: a fit
            # extrapolated past its calibrated sizes must not make a cache hit look dearer than a miss.
            per_step += count * (min(full, self.cost.block_ms(kind, "kv", n, c, self.text, dim)) if cached else full)
        if len(self._memo) > 50_000:
            self._memo.clear()
        self._memo[key] = steps * per_step
        return steps * per_step

    def tier_load_ms(self, tier: str | None) -> float:
        """Bringing an entry in from ``tier`` (the profile's measured reads; the memory tier is mapped, ~free)."""
        return self.scale * self.cost.load_ms(self.entry_bytes, DISK) if tier == DISK else 0.0

    def model_ms(self, f: EditFeatures, load: BackendLoad) -> float:
        if f.model is None or load.holds_model(f.model):
            return 0.0
        # adapters the request counts but does not name (a trace's num_lora): loaded with their checkpoint
        return self.model_load_ms + (0 if f.adapters else f.loras) * self.lora_load_ms

    def adapter_ms(self, f: EditFeatures, load: BackendLoad, now: float) -> float:
        """Cold loads of the request's named adapters that ``load`` has not recently been routed."""
        return load.adapters.missing(f.adapters, now) * self.lora_load_ms if f.adapters else 0.0

    def eviction_ms(self, f: EditFeatures, load: BackendLoad) -> float:
        """What loading ``f``'s checkpoint on ``load`` costs later: with every slot taken it evicts the least recently
        used checkpoint, which its next request there loads again (charged to the choice, not to the backlog)."""
        if f.model is None or load.holds_model(f.model) or len(load.models) < load.model_slots:
            return 0.0
        return self.model_load_ms

    def cost_ms(self, f: EditFeatures, load: BackendLoad, now: float, hit_ms: float | None = None,
                miss_ms: float | None = None) -> float:
        """The request's own work on ``load``: compute at the tier its entry is in, the entry's load, the model's."""
        tier = load.tier(f.template_key, now)
        if tier is None:
            c = self.request_ms(f, False) if miss_ms is None else miss_ms
        else:
            c = (self.request_ms(f, True) if hit_ms is None else hit_ms) + self.tier_load_ms(tier)
        return c + self.model_ms(f, load) + self.adapter_ms(f, load, now)

    def observe(self, predicted_ms: float, observed_ms: float, predicted_scale: float | None = None,
                alpha: float = 0.1) -> None:
        """A request predicted to complete in ``predicted_ms`` (at routing time, with the scale then:
        ``predicted_scale``, default the current one) took ``observed_ms``. The fit moves toward observed /
        unscaled prediction; relative to the scale *at prediction*, so a burst routed before any completion does
        not compound its error into the scale."""
        if predicted_ms > 0 and observed_ms > 0:
            at = self.scale if predicted_scale is None else predicted_scale
            self.error += alpha * (abs(math.log(observed_ms / predicted_ms)) - self.error)
            self.scale += alpha * (observed_ms / predicted_ms * at - self.scale)
            self.observations += 1

    @property
    def stale(self) -> bool:
        return self.error > self.stale_error
