"""The Triton model repository, described once in Python and rendered to ``config.pbtxt`` files.

``model_repository/`` holds the CPU rendering (committed, checked against this file by a test);
``maskedit-render-repo --kind gpu`` writes the same repository with GPU instance groups, which is what
the Dockerfile serves. One description means the ensemble wiring and the per-model tensors cannot drift.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from maskedit_common.request_fields import REQUEST_FIELDS

from .settings import REPO_ROOT

REPOSITORY = REPO_ROOT / "model_repository"


@dataclass(frozen=True)
class T:
    name: str
    dtype: str  # Triton TYPE_* without the prefix
    dims: tuple[int, ...]
    optional: bool = False


# Ensemble inputs/outputs: the public API (documented in README).
EDIT_INPUTS = [T(f.name, f.dtype, f.dims, optional=f.optional) for f in REQUEST_FIELDS]  # the declared schema
EDIT_OUTPUTS = [T("IMAGE", "STRING", (1,)), T("EDIT_INFO", "STRING", (1,))]

# Tensors between the stages.
PREPARED = [
    T("LATENTS", "FP32", (-1, -1)),
    T("COND", "FP32", (-1, -1)),
    T("PROMPT_EMBEDS", "FP32", (-1, -1)),
    T("POOLED_EMBEDS", "FP32", (-1,)),
    T("TOKEN_MASK", "BOOL", (-1,)),
    T("MODEL_SIZE", "INT32", (2,)),  # (width, height) the model runs at
    T("STEPS_RESOLVED", "INT32", (1,)),
    T("GUIDANCE_RESOLVED", "FP32", (1,)),
    # One row per control: the family's prepared control image (``ModelFamily.prepare_control_image``) flattened;
    # its shape and spec travel in REQUEST_INFO's "controls". (0, 0) without controls.
    T("CONTROL_COND", "FP32", (-1, -1)),
    # An in-context edit model's reference images beyond the template (``ModelFamily.prepare_references``): their
    # tokens (R, C) and each image's token grid (rows, cols). (0, 0) and (0, 2) without any.
    T("REFERENCE", "FP32", (-1, -1)),
    T("REFERENCE_GRIDS", "INT32", (-1, 2)),
]
PASSTHROUGH = [  # what vae_decode needs; it may only take inputs from masked_denoise, so denoise relays them
    T("TEMPLATE_RGB", "UINT8", (-1, -1, 3)),
    T("ALPHA", "UINT8", (-1, -1)),
    T("REQUEST_INFO", "STRING", (1,)),
]
# The ``controlnet`` model (``maskedit.controlnets.wire``): one request's ControlNets at one step, and their residuals
# packed in one tensor with their shapes.
CONTROLNET_IN = [
    T("CONTROLNETS", "STRING", (-1,)), T("SCALES", "FP64", (-1,)), T("MODES", "STRING", (-1,)),
    # the UNet families' ControlNet arguments
    T("CONTROL_IMAGES", "FP32", (-1, -1, -1, -1), optional=True), T("SAMPLE", "FP32", (-1, -1, -1, -1), optional=True),
    T("TIMESTEP", "FP32", (-1,)), T("ENCODER_HIDDEN_STATES", "FP32", (-1, -1, -1)),
    T("TEXT_EMBEDS", "FP32", (-1, -1), optional=True), T("TIME_IDS", "FP32", (-1, -1), optional=True),
    # the Flux families' (``maskedit.controlnets.flux_remote``)
    T("LATENTS", "FP32", (-1, -1, -1), optional=True), T("CONTROL_LATENTS", "FP32", (-1, -1, -1), optional=True),
    T("POOLED_PROJECTIONS", "FP32", (-1, -1), optional=True), T("GUIDANCE", "FP32", (-1,), optional=True),
    T("TXT_IDS", "FP32", (-1, -1), optional=True), T("IMG_IDS", "FP32", (-1, -1), optional=True),
    T("STRUCTURE", "INT64", (2,), optional=True),
]
CONTROLNET_OUT = [T("RESIDUALS", "FP32", (-1,)), T("RESIDUAL_SHAPES", "INT64", (-1, -1)), T("COMPUTE_S", "FP64", (1,)),
                  T("RESIDUAL_GROUPS", "INT64", (-1,))]
DENOISED = [T("DENOISED", "FP32", (-1, -1)), T("MODEL_SIZE_OUT", "INT32", (2,))]
RELAYED = [T(t.name + "_OUT", t.dtype, t.dims) for t in PASSTHROUGH]


# The ensemble's first step, ``intake`` (``maskedit.intake``): a light model that sees each request within about a
# millisecond of its arrival and refuses it at once, before pre-processing (image decoding, the VAE and text encoders),
# when PREPROCESS_WAITING already wait in front of ``preprocess`` or the denoise queue is full; and it hands
# ``preprocess`` a lower bound on the request's arrival (INTAKE_INFO). It holds the bound that Triton's queue policy
# held before: a policy lives in a ``dynamic_batching`` block, whose batcher thread in Triton 2.51 re-polls every
# 500 ms instead of being woken when the instance frees (docs/reliability.md, "In front of pre-processing"), which
# paced pre-processing's executions 0.5 s apart in a flood. No model here has such a block: Triton's default
# scheduler hands a queued request to a waiting instance at once. One that passes then meets the denoise queue's
# bound (MASKEDIT_MAX_QUEUE).
PREPROCESS_WAITING = 16
INTAKE_INFO = T("INTAKE_INFO", "STRING", (1,))


@dataclass(frozen=True)
class Model:
    name: str
    inputs: list[T]
    outputs: list[T]
    decoupled: bool = False
    instances: int = 1
    parameters: dict = field(default_factory=dict)


def models() -> list[Model]:
    return [
        Model("intake", [T("PROMPT", "STRING", (1,))], [INTAKE_INFO]),  # PROMPT: required, a few bytes, no images
        # INTAKE_INFO optional: a direct call (no ensemble, no intake) still works, its arrival inferred here
        Model("preprocess", EDIT_INPUTS + [T(INTAKE_INFO.name, "STRING", (1,), optional=True)],
              PREPARED + PASSTHROUGH),
        Model("masked_denoise", PREPARED + PASSTHROUGH, DENOISED + RELAYED, decoupled=True),
        Model("vae_decode", [*(T(t.name, t.dtype, t.dims) for t in DENOISED + RELAYED)], EDIT_OUTPUTS),
        Model("cancel", [T("REQUEST_IDS", "STRING", (-1,))], [T("CANCELLED", "INT32", (1,))]),
        Model("controlnet", CONTROLNET_IN, CONTROLNET_OUT),  # called through BLS by masked_denoise, not the ensemble
    ]


def _tensor(t: T, indent: str) -> str:
    lines = [f'{indent}  name: "{t.name}"', f"{indent}  data_type: TYPE_{t.dtype}",
             f"{indent}  dims: [ {', '.join(map(str, t.dims))} ]"]
    if t.optional:
        lines.append(f"{indent}  optional: true")
    return f"{indent}{{\n" + "\n".join(lines) + f"\n{indent}}}"


def _tensors(key: str, ts: list[T]) -> str:
    return f"{key} [\n" + ",\n".join(_tensor(t, "  ") for t in ts) + "\n]"


def render_model(m: Model, kind: str) -> str:
    parts = [f'name: "{m.name}"', 'backend: "python"', "max_batch_size: 0"]
    if m.decoupled:
        parts.append("model_transaction_policy {\n  decoupled: true\n}")
    parts += [_tensors("input", m.inputs), _tensors("output", m.outputs)]
    parts.append(f"instance_group [\n  {{\n    count: {m.instances}\n    kind: KIND_{kind.upper()}\n  }}\n]")
    for k, v in m.parameters.items():
        parts.append(f'parameters {{\n  key: "{k}"\n  value: {{ string_value: "{v}" }}\n}}')
    return "\n".join(parts) + "\n"


def _step(model: str, mapping_in: dict[str, str], mapping_out: dict[str, str]) -> str:
    ins = "\n".join(f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in mapping_in.items())
    outs = "\n".join(f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in mapping_out.items())
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n{ins}\n{outs}\n    }}'


def render_ensemble() -> str:
    """``edit`` = intake -> preprocess -> masked_denoise (decoupled) -> vae_decode."""
    pre_out = {t.name: f"_{t.name.lower()}" for t in PREPARED + PASSTHROUGH}
    den_in = {t.name: f"_{t.name.lower()}" for t in PREPARED + PASSTHROUGH}
    den_out = {t.name: f"_{t.name.lower()}" for t in DENOISED + RELAYED}
    dec_in = dict(den_out)
    dec_out = {t.name: t.name for t in EDIT_OUTPUTS}
    intake = f"_{INTAKE_INFO.name.lower()}"
    steps = [
        _step("intake", {"PROMPT": "PROMPT"}, {INTAKE_INFO.name: intake}),
        _step("preprocess", {**{t.name: t.name for t in EDIT_INPUTS}, INTAKE_INFO.name: intake}, pre_out),
        _step("masked_denoise", den_in, den_out),
        _step("vae_decode", dec_in, dec_out),
    ]
    return "\n".join([
        'name: "edit"', 'platform: "ensemble"', "max_batch_size: 0",
        _tensors("input", EDIT_INPUTS), _tensors("output", EDIT_OUTPUTS),
        "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}",
    ]) + "\n"


def render(kind: str = "cpu") -> dict[str, str]:
    """Relative path -> config.pbtxt text for the whole repository."""
    out = {f"{m.name}/config.pbtxt": render_model(m, kind) for m in models()}
    out["edit/config.pbtxt"] = render_ensemble()
    return out


def write(dest: Path, kind: str) -> None:
    """Write a full repository (configs + model.py shims) to ``dest``."""
    dest = Path(dest)
    if dest.resolve() != REPOSITORY.resolve():
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(REPOSITORY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in render(kind).items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
        (dest / rel).parent.joinpath("1").mkdir(exist_ok=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Render the Triton model repository for CPU or GPU instances.")
    ap.add_argument("--kind", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--out", type=Path, default=REPOSITORY, help="destination (default: model_repository/)")
    args = ap.parse_args(argv)
    write(args.out, args.kind)
    print(f"wrote {args.kind} repository to {args.out}")


if __name__ == "__main__":
    main()
