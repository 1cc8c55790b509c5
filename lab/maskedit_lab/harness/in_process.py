"""In-process set-up shared by the calibration command and the engine benchmark: a model, a store in a
temporary directory, a registered template and requests with exact token-level mask ratios."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from maskedit_client import encode_image
from PIL import Image

from maskedit import samples
from maskedit.cache.loader import RowLoader
from maskedit.cache.runtime import CacheRuntime
from maskedit.cache.store import ActivationStore
from maskedit.denoise import DenoiseInputs, ModelRunner
from maskedit.engine import DenoiseEngine
from maskedit.local import denoise_inputs, run_job
from maskedit.params import parse_params
from maskedit.preprocess import Preprocessor
from maskedit.build_model import build
from maskedit.families import preset_family
from maskedit_common.cost_model import CostModel
from maskedit_common.settings import load_settings

from .. import REPO_ROOT
from .baselines import InlineRowLoader, InlineWorkEngine, PerResolutionRunner, cache_policy


png = encode_image  # PNG bytes of a PIL image or uint8 array, as clients send them


def token_mask_image(grid_w: int, grid_h: int, patch: int, ratio: float, seed: int) -> np.ndarray:
    """A blob mask covering exactly round(ratio * tokens) tokens, drawn at token resolution."""
    rng = np.random.default_rng(seed)
    field = samples.blob_mask(grid_w * 4, grid_h * 4, 0.5, rng).astype(np.float32)
    field = np.asarray(Image.fromarray(field.astype(np.uint8)).resize((grid_w, grid_h), Image.BILINEAR), np.float32)
    yy, xx = np.mgrid[0:grid_h, 0:grid_w]
    field = field - 40 * np.hypot(yy / grid_h - 0.5, xx / grid_w - 0.5) + rng.random(field.shape)  # break ties
    k = int(round(ratio * grid_w * grid_h))
    grid = np.zeros(grid_w * grid_h, np.uint8)
    if k:
        grid[np.argsort(-field.reshape(-1), kind="stable")[:k]] = 255
    return np.kron(grid.reshape(grid_h, grid_w), np.ones((patch, patch), np.uint8))


def memory_dir(need: int) -> str | None:
    """/dev/shm when it can hold the store (entries then live in RAM, as when serving), else the default temp dir."""
    try:
        st = os.statvfs("/dev/shm")
        return "/dev/shm" if st.f_bavail * st.f_frsize > 2 * need else None
    except OSError:
        return None


@dataclass
class Harness:
    pre: Preprocessor
    runner: ModelRunner
    hooks: object  # the family's masked-block hooks (``cache.rows.TokenRowHooks`` describes them)
    store: ActivationStore
    template: Image.Image
    steps: int
    cost: CostModel
    controls: str | None = None  # the CONTROLS JSON every request (the registered template's too) carries
    control_images: tuple = ()  # their encoded images, in order
    negative_prompt: str | None = None  # NEGATIVE_PROMPT every request carries (guidance where the family takes it)

    @classmethod
    def create(cls, model_dir: Path | None = None, preset: str = "bench", steps: int | None = None,
               cost: CostModel | None = None, budget_bytes: int = 8 << 30, device: str | None = None,
               dtype: str | None = None) -> "Harness":
        """``device``/``dtype`` override MASKEDIT_DEVICE/MASKEDIT_DTYPE; the environment's other settings apply."""
        model_dir = Path(model_dir or REPO_ROOT / "models" / preset_family(preset).dir_name(preset))
        if not (model_dir / "model_index.json").exists():
            build(model_dir, preset)
        env = {**os.environ, "MASKEDIT_MODEL_DIR": str(model_dir)}
        env.update({k: v for k, v in (("MASKEDIT_DEVICE", device), ("MASKEDIT_DTYPE", dtype)) if v})
        settings = load_settings(env)
        tmp = Path(tempfile.mkdtemp(prefix="maskedit-bench-", dir=memory_dir(budget_bytes)))
        store = ActivationStore(tmp / "mem", tmp / "disk", 64 << 30, 64 << 30)
        pre = Preprocessor(settings, store=store)
        runner = ModelRunner(settings)
        h = cls(pre, runner, runner.family.cache_hooks(runner.transformer), store,
                samples.template(settings.resolution, settings.resolution, seed=3), steps or settings.steps,
                cost or CostModel.fallback())
        h.budget_bytes = budget_bytes
        # The store holds hundreds of MB per run: remove it when the harness goes away (or the process exits).
        weakref.finalize(h, shutil.rmtree, tmp, True)
        return h

    @property
    def settings(self):
        return self.runner.settings

    def inputs(self, mask: np.ndarray, register: bool = False, seed: int = 0,
               loras: str | None = None) -> DenoiseInputs:
        """``loras``: the LORAS JSON (adapters from ``MASKEDIT_LORA_DIR``)."""
        params = parse_params(self.settings, "a red dress", seed=seed, steps=self.steps, register=register,
                              loras=loras, controls=self.controls, negative_prompt=self.negative_prompt)
        return denoise_inputs(self.pre(png(self.template), png(mask), params, control_images=self.control_images))

    def mask(self, ratio: float, seed: int = 0) -> np.ndarray:
        w, h = self.template.size
        patch = self.pre.patch
        return token_mask_image(w // patch, h // patch, patch, ratio, seed)

    def engine(self, policy: str, overlap: bool = True, scheduler=None, max_queue: int = 64,
               pack: bool = True, inline_work: bool = False,
               lora_base_reuse: bool = False) -> tuple[DenoiseEngine, CacheRuntime | None]:
        """A denoise engine on the shared transformer with cache ``policy`` (a serving policy, or a fixed baseline
        of ``baselines.FIXED_POLICIES``); stop it with ``shutdown`` and ``close`` its runtime. Baselines, composed
        from ``baselines``: ``overlap=False`` loads rows inside the block, ``pack=False`` makes one transformer call
        per resolution, ``inline_work=True`` gives an engine whose ``call_soon`` runs work on its loop thread."""
        rt = None if policy == "off" else CacheRuntime(
            self.hooks, self.store, self.cost, policy=cache_policy(policy), budget_bytes=self.budget_bytes,
            loader=RowLoader if overlap else InlineRowLoader, lora_base_reuse=lora_base_reuse)
        runner_cls = ModelRunner if pack else PerResolutionRunner
        runner = runner_cls(self.settings, transformer=self.runner.transformer, cache=rt)
        engine_cls = InlineWorkEngine if inline_work else DenoiseEngine
        return engine_cls(runner, max_queue=max_queue, scheduler=scheduler), rt

    def register(self) -> DenoiseInputs:
        """Record the template (empty mask) so every later mask can hit."""
        x = self.inputs(np.zeros(self.template.size[::-1], np.uint8), register=True)
        eng, rt = self.engine("planner")
        try:
            run_job(eng, x)
            rt.flush(timeout=1800)  # a FLUX.1-size entry is tens of GB to checksum and write
        finally:
            eng.shutdown()
            rt.close()
        return replace(x, register=False)
