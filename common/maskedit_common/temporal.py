"""Temporal reuse (step-to-step caching) of one request, as the ``TEMPORAL`` request field and the server default
``MASKEDIT_TEMPORAL`` spell it: a JSON object naming a policy and its parameters. Shared by the backend (which
carries it out: ``maskedit.temporal``) and the router (whose cost model predicts the work a policy leaves).

The policies follow cache-dit's DBCache (``Fn`` first blocks always computed, the middle blocks skipped on a step
whose first-blocks residual changed by less than ``threshold`` relative to the last computed step, their residual
reused; ``Bn`` last blocks always computed), which covers Diffusers' ``FirstBlockCache`` (``Fn=1, Bn=0``, no
warm-up):

- ``{"policy": "fbcache", "threshold": 0.08}``: Diffusers' First Block Cache;
- ``{"policy": "dbcache", "threshold": 0.08, "fn": 1, "bn": 0, "warmup": 0, "max_cached_steps": -1,
  "max_continuous_cached_steps": -1}``: cache-dit's DBCache;
- ``{"policy": "taylorseer", "order": 1, ...}``: DBCache whose reused residual is forecast by TaylorSeer (order 1 or
  2; cache-dit's ``TaylorSeerCalibrator``) instead of reused as is; with ``"steps"`` a static step mask decides;
- ``{"policy": "steps", "steps": [0, 1, 2, 4, 6], "fn": 1, "bn": 0}``: a fixed list of computed steps (cache-dit's
  ``steps_computation_mask`` with the ``static`` policy); the others reuse the residual.
- ``{"policy": "off"}`` (or an empty field): none; turns a server default off for one request.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

FIELD = "TEMPORAL"
POLICIES = ("off", "fbcache", "dbcache", "taylorseer", "steps")
# The keys each policy takes (besides "policy").
_DBCACHE = ("threshold", "fn", "bn", "warmup", "max_cached_steps", "max_continuous_cached_steps")
KEYS = {"off": (), "fbcache": ("threshold",), "dbcache": _DBCACHE,
        "taylorseer": _DBCACHE + ("order", "steps"), "steps": ("steps", "fn", "bn", "order")}
MAX_ORDER = 2


class TemporalSpecError(ValueError):
    """A bad ``TEMPORAL`` value; ``field`` names the request input."""

    field = FIELD


@dataclass(frozen=True)
class TemporalSpec:
    policy: str = "off"
    threshold: float = 0.0  # relative L1 change of the first blocks' residual under which a step reuses (0: never)
    fn: int = 1  # first blocks always computed (their residual decides)
    bn: int = 0  # last blocks always computed
    warmup: int = 0  # leading steps always computed
    max_cached_steps: int = -1  # at most this many reused steps per request (-1: no limit)
    max_continuous_cached_steps: int = -1  # at most this many reused steps in a row (-1: no limit)
    order: int = 0  # TaylorSeer order of the forecast residual (0: reused as is)
    steps: tuple[int, ...] | None = None  # the computed steps (a static step mask); None: decided by threshold

    @property
    def on(self) -> bool:
        return self.policy != "off"

    @property
    def static(self) -> bool:
        """Decided before the step (a step mask), not from the first blocks' residual."""
        return self.steps is not None

    def computes(self, step: int) -> bool | None:
        """A static policy's decision for ``step`` (True: computed); None when the residual decides."""
        if not self.static:
            return None
        return step in self.steps

    def as_dict(self) -> dict:
        """The canonical JSON object (what travels between the stages and names the policy in metrics)."""
        if not self.on:
            return {"policy": "off"}
        d = {k: v for k, v in asdict(self).items() if k in ("policy",) + KEYS[self.policy]}
        if d.get("steps") is not None:
            d["steps"] = list(d["steps"])
        elif "steps" in d:
            del d["steps"]
        return d

    def label(self) -> str:
        """A short name for metrics and logs: ``fbcache(0.08)``, ``steps(5/8)``."""
        if not self.on:
            return "off"
        if self.static:
            return f"{self.policy}({len(self.steps)}" + (f",o{self.order})" if self.order else ")")
        return f"{self.policy}({self.threshold:g}" + (f",o{self.order})" if self.order else ")")


OFF = TemporalSpec()


def _int(d: dict, key: str, lo: int, hi: int | None = None) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise TemporalSpecError(f'"{key}" must be a whole number from {lo}' + (f" to {hi}" if hi is not None else "")
                                + f", got {json.dumps(v)[:40]}")
    return v


def parse(text, steps: int) -> TemporalSpec:
    """The spec in ``text`` (JSON object text, a dict, or empty: off) for a request of ``steps`` steps. Raises
    ``TemporalSpecError`` naming what is wrong. The block counts (``fn + bn`` below the model's blocks) are checked
    when the request is admitted, where the model is known."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if text is None or (isinstance(text, str) and not text.strip()):
        return OFF
    if isinstance(text, str):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise TemporalSpecError(f"is not valid JSON ({e.msg} at character {e.pos})") from None
    else:
        d = text
    if isinstance(d, str):
        d = {"policy": d}
    if not isinstance(d, dict):
        raise TemporalSpecError('must be a JSON object such as {"policy": "fbcache", "threshold": 0.08}')
    policy = d.get("policy")
    if policy not in POLICIES:
        raise TemporalSpecError(f'"policy" must be one of {", ".join(POLICIES)}, got {json.dumps(policy)[:40]}')
    unknown = sorted(set(d) - {"policy", *KEYS[policy]})
    if unknown:
        raise TemporalSpecError(f'policy "{policy}" takes {", ".join(KEYS[policy]) or "no parameters"}; '
                                f'unknown {", ".join(unknown)}')
    if policy == "off":
        return OFF
    out = {"policy": policy}
    if "threshold" in d:
        t = d["threshold"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 or t > 1:
            raise TemporalSpecError(f'"threshold" must be a number from 0 to 1, got {json.dumps(t)[:40]}')
        out["threshold"] = float(t)
    elif policy in ("fbcache", "dbcache") or (policy == "taylorseer" and "steps" not in d):
        raise TemporalSpecError(f'policy "{policy}" needs "threshold" (0 to 1; 0 never reuses)')
    for key, lo in (("fn", 1), ("bn", 0), ("warmup", 0), ("max_cached_steps", -1),
                    ("max_continuous_cached_steps", -1)):
        if key in d:
            out[key] = _int(d, key, lo)
    if "order" in d:
        out["order"] = _int(d, "order", 0 if policy == "steps" else 1, MAX_ORDER)
    elif policy == "taylorseer":
        raise TemporalSpecError(f'policy "taylorseer" needs "order" (1 to {MAX_ORDER})')
    if "steps" in d:
        s = d["steps"]
        if not isinstance(s, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in s):
            raise TemporalSpecError('"steps" must be a list of step indices (whole numbers)')
        bad = [i for i in s if i < 0 or i >= steps]
        if bad:
            raise TemporalSpecError(f'"steps" holds {bad[0]}, outside 0 to {steps - 1} (the request has {steps} '
                                    f'steps)')
        if 0 not in s:
            raise TemporalSpecError('"steps" must include step 0 (a reused step needs a computed one before it)')
        out["steps"] = tuple(sorted(set(s)))
    elif policy == "steps":
        raise TemporalSpecError('policy "steps" needs "steps": the list of computed step indices')
    return TemporalSpec(**out)


def check_blocks(spec: TemporalSpec, n_blocks: int) -> None:
    """``fn + bn`` must leave at least one middle block to skip."""
    if spec.on and spec.fn + spec.bn >= n_blocks:
        raise TemporalSpecError(f'"fn" + "bn" is {spec.fn + spec.bn}, and this model has {n_blocks} blocks: at most '
                                f"{n_blocks - 1} (at least one block must be left to reuse)")


def step_fraction(spec: TemporalSpec, n_blocks: int) -> float:
    """The blocks a reused step still computes, as a fraction of a computed step's."""
    return min(1.0, (spec.fn + spec.bn) / max(1, n_blocks))


def computed_fraction(spec: TemporalSpec, steps: int, n_blocks: int, reused_steps: float | None = None) -> float:
    """The fraction of a request's block evaluations a policy computes: exact for a step mask, from
    ``reused_steps`` (observed or expected) for the adaptive policies (None: assume none reused)."""
    if not spec.on or steps <= 0:
        return 1.0
    if spec.static:
        reused_steps = steps - len(spec.steps)
    reused = min(float(reused_steps or 0.0), float(steps))
    return ((steps - reused) + reused * step_fraction(spec, n_blocks)) / steps


def step_mask(steps: int, fraction: float, warmup: int = 1) -> list[int]:
    """A step mask computing about ``fraction`` of ``steps``: the first ``warmup`` steps, then evenly spread ones
    (cache-dit's ``steps_mask`` helper bins them by hand; this picks the same kind of schedule from one number)."""
    keep = max(warmup, min(steps, int(round(fraction * steps))))
    rest = keep - warmup
    if rest <= 0:
        return list(range(warmup))
    span = steps - warmup
    picked = {warmup + int(math.floor(i * span / rest)) for i in range(rest)}
    return sorted(set(range(warmup)) | picked)
