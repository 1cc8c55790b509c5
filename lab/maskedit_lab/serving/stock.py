"""The baseline users compare us with: stock Diffusers ``FluxFillPipeline``, one request at a time, served as a
thin Triton Python model (as the Triton tutorials serve a Diffusers pipeline).

It takes the same inputs as the ``edit`` ensemble's core (``TEMPLATE``, ``MASK``, ``PROMPT``, ``SEED``, ``STEPS``,
``GUIDANCE``), validated the same way, runs the pipeline at the same model size, and returns the PNG at the
template's size and ``EDIT_INFO`` with its timings. No caching, no batching, no pre/post-processing split.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from maskedit.components import load_transformer, torch_dtype
from maskedit.device import synchronize
from maskedit.imaging import decode_image, encode_png, maybe_base64, model_size
from maskedit.params import parse_params
from maskedit_common.settings import Settings

MODEL_NAME = "diffusers_baseline"
INPUTS = [("TEMPLATE", "TYPE_STRING", False), ("MASK", "TYPE_STRING", False), ("PROMPT", "TYPE_STRING", False),
          ("SEED", "TYPE_INT64", True), ("STEPS", "TYPE_INT32", True), ("GUIDANCE", "TYPE_FP32", True)]


class StockEditor:
    def __init__(self, settings: Settings):
        from diffusers import FluxFillPipeline

        self.settings = settings
        # A generated-weights preset has no transformer files: build it as the service does, then hand it over.
        self.pipe = FluxFillPipeline.from_pretrained(settings.model_dir, dtype=torch_dtype(settings),
                                                     transformer=load_transformer(settings))
        self.pipe.set_progress_bar_config(disable=True)
        self.pipe.to(settings.torch_device)

    def edit(self, template: bytes, mask: bytes, prompt: bytes | str, seed=None, steps=None,
             guidance=None) -> tuple[bytes, dict]:
        t0 = time.perf_counter()
        s = self.settings
        params = parse_params(s, prompt, seed=seed, steps=steps, guidance=guidance)
        tpl = decode_image(maybe_base64(template)[0], "TEMPLATE", s.max_input_pixels).convert("RGB")
        msk = decode_image(maybe_base64(mask)[0], "MASK", s.max_input_pixels).convert("L")
        w, h = model_size(*tpl.size, s.resolution)
        t1 = time.perf_counter()
        out = self.pipe(prompt=params.prompt, image=tpl.resize((w, h), Image.BICUBIC),
                        mask_image=msk.resize((w, h), Image.NEAREST), height=h, width=w,
                        num_inference_steps=params.steps, guidance_scale=params.guidance,
                        max_sequence_length=s.max_sequence_length,
                        generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
        synchronize(s.torch_device)
        t2 = time.perf_counter()
        png = encode_png(np.asarray(out.resize(tpl.size, Image.BICUBIC)))
        return png, {"pipeline_s": round(t2 - t1, 6), "total_s": round(time.perf_counter() - t0, 6),
                     "steps": params.steps, "model_size": [w, h], "baseline": "diffusers"}


def render(repository: Path, kind: str = "cpu") -> Path:
    """Write the baseline's Triton model (config + shim) into ``repository``."""
    d = Path(repository) / MODEL_NAME
    (d / "1").mkdir(parents=True, exist_ok=True)
    inputs = ",\n".join(
        f'  {{ name: "{n}" data_type: {t} dims: [ 1 ]{" optional: true" if opt else ""} }}' for n, t, opt in INPUTS)
    group = "KIND_GPU" if kind == "gpu" else "KIND_CPU"
    (d / "config.pbtxt").write_text(
        f'name: "{MODEL_NAME}"\nbackend: "python"\nmax_batch_size: 0\ninput [\n{inputs}\n]\noutput [\n'
        '  { name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] },\n'
        '  { name: "EDIT_INFO" data_type: TYPE_STRING dims: [ 1 ] }\n]\n'
        f"instance_group [ {{ count: 1 kind: {group} }} ]\n")
    (d / "1" / "model.py").write_text(
        '"""Triton shim for the stock-Diffusers baseline: the logic lives in maskedit_lab.serving.stock."""\n'
        "import os\nimport sys\n\n"
        'sys.path[:0] = [p for p in os.environ.get("MASKEDIT_PYTHONPATH", "").split(os.pathsep) '
        "if p and p not in sys.path]\n\n"
        "from maskedit_lab.serving.stock import TritonPythonModel  # noqa: E402,F401\n")
    return d


class TritonPythonModel:
    """One request at a time (one instance, no batching), exactly as a plain Diffusers deployment runs."""

    def initialize(self, args):
        from maskedit import logs
        from maskedit_common.settings import load_settings

        settings = load_settings()
        self.log = logs.setup(MODEL_NAME, settings.service.log_level)
        self.editor = StockEditor(settings)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        from maskedit.triton import io

        out = []
        for request in requests:
            try:
                kw = {k.lower(): io.scalar(request, k) for k in ("SEED", "STEPS", "GUIDANCE")}
                png, info = self.editor.edit(io.blob(request, "TEMPLATE"), io.blob(request, "MASK"),
                                             io.blob(request, "PROMPT"), **kw)
                out.append(pb_utils.InferenceResponse([io.tensor("IMAGE", png),
                                                       io.tensor("EDIT_INFO", json.dumps(info).encode())]))
            except Exception as e:  # bad input or a failed run: this request's error, the model keeps serving
                self.log.warning("baseline request failed: %s", e)
                out.append(pb_utils.InferenceResponse(error=io.as_triton_error(e)))
        return out
