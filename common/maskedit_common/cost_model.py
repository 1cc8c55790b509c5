"""Profiled latency model: block compute time by mode and token counts, and load time by bytes.

Fitted by ``maskedit-calibrate`` on the current machine and model and stored as ``cost_model_<model>[_<gpu>].json``
in the profiles directory (``Settings.profiles``); read by the engine's planner and by the router. Without a
profile, a FLOP/bandwidth fallback keeps the planner working with the right shape of costs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .blocks import FULL, KV, Y, BlockCost
from .flops import block_flops, unet_block_flops


def profile_name(model_name: str, slug: str) -> str:
    """The file name of the cost profile of ``model_name`` measured on hardware ``slug`` ("cpu", or a GPU's model
    such as "h100"): ``cost_model_<model>.json`` for the CPU (the name the CPU profiles always had),
    ``cost_model_<model>_<gpu>.json`` for a GPU."""
    return f"cost_model_{model_name}.json" if slug == "cpu" else f"cost_model_{model_name}_{slug}.json"


def features(mode: str, n: int, c: int, text: int) -> list[float]:
    """Regressors of a block's latency: constant, query rows, projected cached rows, attention area."""
    if mode == FULL:
        c = n
    q = text + c
    u = n - c if mode == Y else 0
    return [1.0, q / 1000.0, u / 1000.0, q * (text + n) / 1e6]


@dataclass
class LinearFit:
    coef: list[float]
    r2: float

    def predict(self, x: list[float]) -> float:
        return max(0.0, float(np.dot(self.coef, x)))

    @staticmethod
    def fit(xs: list[list[float]], ys: list[float]) -> "LinearFit":
        X, yv = np.asarray(xs, float), np.asarray(ys, float)
        coef, *_ = np.linalg.lstsq(X, yv, rcond=None)
        pred = X @ coef
        ss = float(((yv - yv.mean()) ** 2).sum())
        r2 = 1.0 - float(((yv - pred) ** 2).sum()) / ss if ss > 0 else 1.0
        return LinearFit([float(c) for c in coef], r2)


@dataclass
class CostModel:
    """Milliseconds. ``compute[kind][mode]`` with kind in {dual, single}; ``load[tier]`` over megabytes."""

    compute: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    fallback_flops_per_ms: float = 0.0  # set when no profile: FLOP-proportional estimate

    def block_ms(self, kind: str, mode: str, n: int, c: int, text: int, dim: int) -> float:
        if kind.startswith("unet") and kind not in self.compute:  # a UNet block not calibrated: FLOPs, fallback rate
            return unet_block_flops(mode, n, c, text, dim) / (self.fallback_flops_per_ms or 2e7)
        if self.fallback_flops_per_ms:
            return block_flops(mode, kind == "dual", n, c, text, dim) / self.fallback_flops_per_ms
        return self.compute[kind][mode].predict(features(mode, n, c, text))

    def load_ms(self, nbytes: int, tier: str = "mem") -> float:
        """A block's rows to the device: the copy, and the checksum over them where the profile measured it
        (``load["verify"]``: one thread's hashing; profiles before it priced the copy alone)."""
        if not nbytes:
            return 0.0
        fit = self.load.get(tier) or self.load.get("mem")
        ms = fit.predict([1.0, nbytes / 1e6])
        verify = self.load.get("verify")
        if verify is None:
            return ms
        check = verify.predict([1.0, nbytes / 1e6])
        threads = self.meta.get("verify_threads", 1)
        # A disk entry is verified whole on one thread as it is promoted; in memory, one loader thread hashes each
        # block and then copies it, while verify threads hash side by side ahead of its copies (a step's blocks
        # stream through them: their throughput, not one block's latency, is what a step waits on).
        if tier != "mem" or threads <= 1:
            return ms + check
        return max(ms, check / threads)

    def block_costs(self, kinds: list[str], n: int, c: int, text: int, dim: int, bytes_y: int, bytes_kv: int,
                    has_y: list[bool], has_kv: list[bool], tier: str = "mem") -> list[BlockCost]:
        ly, lkv = self.load_ms(bytes_y, tier), self.load_ms(bytes_kv, tier)
        return [BlockCost(
            compute_full=self.block_ms(k, FULL, n, n, text, dim), compute_y=self.block_ms(k, Y, n, c, text, dim),
            compute_kv=self.block_ms(k, KV, n, c, text, dim), load_y=ly if hy else None,
            load_kv=lkv if hk else None) for k, hy, hk in zip(kinds, has_y, has_kv)]

    def to_json(self) -> dict:
        return {
            "compute": {k: {m: vars(f) for m, f in d.items()} for k, d in self.compute.items()},
            "load": {t: vars(f) for t, f in self.load.items()},
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        return cls(
            compute={k: {m: LinearFit(**f) for m, f in d.items()} for k, d in data["compute"].items()},
            load={t: LinearFit(**f) for t, f in data["load"].items()},
            meta=data.get("meta", {}),
        )

    @classmethod
    def load_file(cls, path: Path) -> "CostModel":
        return cls.from_json(json.loads(Path(path).read_text()))

    @classmethod
    def fallback(cls) -> "CostModel":
        """~20 GFLOP/s of compute and ~4 GB/s of host-memory gathers: a CPU-shaped guess."""
        return cls(load={"mem": LinearFit([0.02, 0.25], 1.0), "disk": LinearFit([0.5, 2.0], 1.0)},
                   meta={"source": "fallback"}, fallback_flops_per_ms=2e7)
