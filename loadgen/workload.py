"""What to send and when: arrival processes, mask-ratio distributions, template popularity, trace files."""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

# InstGenIE's three workloads: mean mask ratio and the mask shapes that dominate them.
WORKLOADS = {
    "production": {"mean": 0.11, "shapes": ("blob", "box")},
    "public": {"mean": 0.19, "shapes": ("blob", "box")},
    "tryon": {"mean": 0.35, "shapes": ("person",)},
}
CONCENTRATION = 8.0  # Beta(mean*k, (1-mean)*k): real masks spread widely around the mean
PROMPTS = ["a red dress", "a yellow sun hat", "a mountain lake", "a green jacket", "white sneakers",
           "a vase of flowers", "remove the object", "a leather bag", "a blue sky with clouds", "curly hair"]


@dataclass
class Request:
    t: float  # arrival, seconds from the start
    template: int
    mask_ratio: float
    mask_shape: str
    prompt: str
    steps: int | None = None
    deadline_ms: int | None = None
    seed: int = 0
    mask_file: str | None = None
    tenant: str | None = None  # sent with that tenant's API key (``tenant_keys``); None: the run's own client
    loras: list | None = None  # LoRA adapters sent as LORAS: [[name, scale], ...] (``assign_loras``)


def mask_ratios(workload: str, n: int, rng: np.random.Generator) -> np.ndarray:
    m = WORKLOADS[workload]["mean"]
    return np.clip(rng.beta(m * CONCENTRATION, (1 - m) * CONCENTRATION, size=n), 0.01, 0.95)


def zipf_templates(n: int, n_templates: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Template ids 0..n_templates-1 with P(rank r) ∝ 1/r^s (0 is the most popular)."""
    p = 1.0 / np.arange(1, n_templates + 1) ** s
    return rng.choice(n_templates, size=n, p=p / p.sum())


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def synthesize(arrivals: np.ndarray, workload: str = "public", n_templates: int = 8, zipf_s: float = 1.1,
               steps: int | None = None, deadline_ms: int | None = None, seed: int = 0,
               fixed_ratio: float | None = None) -> list[Request]:
    rng = np.random.default_rng(seed)
    n = len(arrivals)
    ratios = np.full(n, fixed_ratio) if fixed_ratio is not None else mask_ratios(workload, n, rng)
    templates = zipf_templates(n, n_templates, zipf_s, rng)
    shapes = WORKLOADS[workload]["shapes"]
    return [Request(t=float(arrivals[i]), template=int(templates[i]), mask_ratio=float(ratios[i]),
                    mask_shape=shapes[int(rng.integers(len(shapes)))], prompt=PROMPTS[int(rng.integers(len(PROMPTS)))],
                    steps=steps, deadline_ms=deadline_ms, seed=int(rng.integers(1 << 31))) for i in range(n)]


def poisson(rate: float, n: int, **kw) -> list[Request]:
    return synthesize(poisson_arrivals(rate, n, np.random.default_rng(kw.get("seed", 0) + 1)), **kw)


GENTD26 = Path(__file__).resolve().parent / "traces" / "gentd26_requests.csv.gz"  # see traces/README.md


def gentd26_arrivals(path: str | Path = GENTD26, time_scale: float = 1.0, types: tuple[str, ...] = ("INPAINTING", "IMG_2_IMG"),
                     limit: int | None = None, start: int = 0, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """Arrival offsets (s) and step counts from the GenTD26 request log, compressed by ``time_scale``
    (10 = ten times faster). Timestamps have second resolution; arrivals are spread uniformly in their second."""
    rng = np.random.default_rng(seed)
    times, rows = _trace_rows(path, types)
    t = times + rng.random(len(times))
    steps = [int(float(row["num_inference_steps"] or 0)) for row in rows]
    t, steps = t[start:], steps[start:]
    if limit is not None:
        t, steps = t[:limit], steps[:limit]
    return (t - t[0]) / time_scale, steps


def gentd26_groups(path: str | Path = GENTD26, types: tuple[str, ...] = ("INPAINTING", "IMG_2_IMG"),
                   limit: int | None = None, start: int = 0) -> list[str]:
    """The ``groupId`` (the production service's tenant) of each request ``gentd26_arrivals`` returns, in the same
    order and window: replayed as tenants, each with its own key."""
    groups = [row.get("groupId") or "none" for row in _trace_rows(path, types)[1]][start:]
    return groups[:limit] if limit is not None else groups


def _trace_rows(path, types: tuple[str, ...]) -> tuple[np.ndarray, list[dict]]:
    """The trace's requests of ``types`` in time order (stable): their times (s) and rows."""
    times, rows = [], []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        for row in csv.DictReader(f):
            if types and row["predict_type"] not in types:
                continue
            times.append(datetime.strptime(row["gmt_create"], "%Y-%m-%d %H:%M:%S").timestamp())
            rows.append(row)
    order = np.argsort(times, kind="stable")
    return np.asarray(times, float)[order], [rows[i] for i in order]


def gentd26_num_lora(path: str | Path = GENTD26, types: tuple[str, ...] = ("INPAINTING", "IMG_2_IMG"),
                     limit: int | None = None, start: int = 0) -> list[int]:
    """The ``num_lora`` (LoRA adapters the production request carried) of each request ``gentd26_arrivals``
    returns, in the same order and window."""
    n = [int(float(row.get("num_lora") or 0)) for row in _trace_rows(path, types)[1]][start:]
    return n[:limit] if limit is not None else n


LORA_SCALES = (0.5, 1.0)  # a drawn adapter's scale: uniform in this range, two decimals


def zipf_loras(num_lora, library: list[str], zipf_s: float, rng: np.random.Generator,
               max_loras: int = 4) -> list[list]:
    """For each request, ``num_lora`` distinct adapters (at most ``max_loras`` and the library's size) drawn
    without replacement with P(rank r) ∝ 1/r^s over ``library`` in its order (the first is the most popular), each
    with a scale from ``LORA_SCALES``: ``[[name, scale], ...]`` (empty without adapters)."""
    if not library:
        return [[] for _ in num_lora]
    p = 1.0 / np.arange(1, len(library) + 1) ** zipf_s
    p /= p.sum()
    out = []
    for k in num_lora:
        k = min(int(k), max_loras, len(library))
        idx = rng.choice(len(library), size=k, replace=False, p=p) if k else []
        out.append([[library[i], round(float(rng.uniform(*LORA_SCALES)), 2)] for i in idx])
    return out


def assign_loras(requests: list[Request], num_lora, library: list[str], zipf_s: float = 1.1, seed: int = 0,
                 max_loras: int = 4) -> list[Request]:
    """Give ``requests`` the adapters of a trace's ``num_lora`` (one count per request, in order), drawn by
    ``zipf_loras`` from their own seeded generator (the rest of the workload draws the same with or without)."""
    if len(num_lora) < len(requests):
        raise ValueError(f"num_lora: {len(num_lora)} counts for {len(requests)} requests")
    drawn = zipf_loras(num_lora[:len(requests)], library, zipf_s, np.random.default_rng([seed, 29]), max_loras)
    for r, loras in zip(requests, drawn):
        r.loras = loras or None
    return requests


def tenant_keys(tenants, seed: int = 0) -> dict[str, str]:
    """A key for each tenant name (deterministic from ``seed``: a replay's key file and its clients agree)."""
    rng = np.random.default_rng(seed)
    return {t: "sk-load-" + "".join(f"{b:02x}" for b in rng.integers(0, 256, 16)) for t in sorted(set(tenants))}


def write_key_file(path: str | Path, keys: dict[str, str], weights: dict[str, float] | None = None,
                   role: str = "user") -> None:
    """The router's key file for ``keys`` (tenant -> key): one line each, tenant names made key-file safe."""
    lines = []
    for tenant, key in keys.items():
        name = "".join(c if c.isalnum() or c in "._-" else "-" for c in tenant)[:64] or "tenant"
        w = (weights or {}).get(tenant)
        lines.append(f"{key} {name} {role}" + (f" weight={w:g}" if w else ""))
    Path(path).write_text("\n".join(lines) + "\n")


def load_trace(path: str | Path) -> list[Request]:
    """A trace file of our own: JSON lines or CSV with the ``Request`` fields (t, template, mask_ratio or
    mask_file, prompt, steps, deadline_ms)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        out.append(Request(
            t=float(r["t"]), template=int(r.get("template", 0)), mask_ratio=float(r.get("mask_ratio") or 0.2),
            mask_shape=r.get("mask_shape") or "blob", prompt=r.get("prompt") or PROMPTS[0],
            steps=int(r["steps"]) if r.get("steps") else None,
            deadline_ms=int(r["deadline_ms"]) if r.get("deadline_ms") else None,
            seed=int(r.get("seed") or 0), mask_file=r.get("mask_file") or None,
            loras=_loras(r.get("loras"))))
    return sorted(out, key=lambda q: q.t)


def _loras(value) -> list | None:
    """A trace row's adapters: a list, or its JSON text in a CSV cell."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return value or None


def save_trace(requests: list[Request], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in requests))
