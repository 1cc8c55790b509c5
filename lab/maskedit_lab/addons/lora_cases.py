"""The LoRA cases of ``bench_addons``: the bench preset's (warm, merged, cold, batched) on the shared runner, the
stock pipeline's per-request LoRA lifecycle, and the FLUX.1-width blocks (``flux_width_blocks``)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from maskedit.adapters import delta, merge
from maskedit.adapters.library import AdapterLibrary
from maskedit.adapters.runtime import AdapterRuntime

from ..harness.in_process import Harness
from . import flux_width_blocks
from .timing import clock, count_flops, drive, since, sync

RANK = 16
NAMES = ("r16-a", "r16-b", "r16-c", "r16-d")


def fresh_runtime(runner, library_dir: Path) -> AdapterRuntime:
    """A runtime whose per-process cache is empty (a fresh library too: the file's digest is read again). A shared
    host-memory adapter tier would be handed in here (cold-host: a hit there, a miss here)."""
    return AdapterRuntime(runner.family, runner.transformer, AdapterLibrary(library_dir))


def use_runtime(runner, runtime: AdapterRuntime) -> None:
    """The runner resolves (and loads) requests' adapters with ``runtime`` from now on."""
    from maskedit.adapters.jobs import AdapterJobs

    runner._adapter_jobs = AdapterJobs(runtime)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class BenchCases:
    """The bench preset's cases: each a (setup, run) on the shared runner."""

    def __init__(self, h: Harness, lib_dir: Path):
        self.h, self.runner, self.lib_dir = h, h.runner, lib_dir
        self.warm = AdapterRuntime(self.runner.family, self.runner.transformer, AdapterLibrary(lib_dir))
        use_runtime(self.runner, self.warm)
        self.merger = merge.merger_for(self.runner.transformer)
        self.x = h.inputs(h.mask(0.3, seed=1))
        lib = AdapterLibrary(lib_dir)
        self.refs = {n: lib.file(n) for n in NAMES}
        self.loaded = {n: self.warm.get(self._ref(n)) for n in NAMES}
        for a in self.loaded.values():  # hooks go on here (serving puts them on at admission)
            delta.attach(self.runner.transformer, a)
        drive(self.runner, [self._with(NAMES[0])])  # warm-up; the merge cost model measures its constants here

    def _ref(self, name: str, scale: float = 0.8):
        from maskedit.adapters.library import ResolvedRef

        return ResolvedRef(name, scale, self.refs[name].digest)

    def _with(self, *names):
        return replace(self.x, loras=tuple(self._ref(n, 0.8 - 0.2 * i) for i, n in enumerate(names)))

    def cases(self) -> dict:
        one, two = self._with(NAMES[0]), self._with(NAMES[0], NAMES[1])
        mixed = [self._with(n) for n in NAMES]
        return {  # case -> (inputs, merge mode, how the runtime is set up)
            "base": ([self.x], "auto", "warm"), "base-unhooked": ([self.x], "auto", "unhooked"),
            "warm-1": ([one], "never", "warm"), "warm-1-merged": ([one], "always", "warm"),
            "warm-2": ([two], "never", "warm"), "warm-2-merged": ([two], "always", "warm"),
            "cold-host": ([one], "auto", "cold-host"), "cold-disk": ([one], "auto", "cold-disk"),
            "same-batch": ([one] * 4, "never", "warm"), "same-batch-merged": ([one] * 4, "always", "warm"),
            "mixed-batch": (mixed, "never", "warm"), "base-batch": ([self.x] * 4, "auto", "warm"),
        }

    def run(self, inputs, mode: str, setup: str, flops: bool = False):
        """One run of a case; returns (seconds or FLOPs, merger stats delta)."""
        t = self.runner.transformer
        self.merger.mode = mode
        self.merger.clear()  # merged cases pay their merge
        use_runtime(self.runner, self.warm)
        if setup == "unhooked":
            delta.detach(t)
        elif setup.startswith("cold"):
            use_runtime(self.runner, fresh_runtime(self.runner, self.lib_dir))
            if setup == "cold-disk":
                drop_page_cache(self.refs[NAMES[0]].path)
            else:
                self.refs[NAMES[0]].path.read_bytes()  # in the page cache
        before = dict(self.merger.stats)
        try:
            out = count_flops(lambda: drive(self.runner, inputs)) if flops else drive(self.runner, inputs)
        finally:
            if setup == "unhooked":
                for a in self.loaded.values():
                    delta.attach(t, a)
            use_runtime(self.runner, self.warm)
            self.merger.mode = "auto"
        return out, {k: self.merger.stats[k] - before[k] for k in before}


def naive_cases(model_dir: Path, lib_dir: Path, h: Harness, device, dtype):
    """The stock pipeline, base and with the per-request LoRA lifecycle users write today; returns two callables
    giving (seconds, {phase: seconds})."""
    from diffusers import FluxFillPipeline

    pipe = FluxFillPipeline.from_pretrained(model_dir, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    tpl, mask = h.template, h.mask(0.3, seed=1)
    from PIL import Image

    kw = dict(prompt="a red dress", image=tpl, mask_image=Image.fromarray(mask), height=tpl.height,
              width=tpl.width, num_inference_steps=h.steps, guidance_scale=30.0, output_type="latent",
              max_sequence_length=h.settings.max_sequence_length)

    def base():
        t0 = clock()
        pipe(generator=torch.Generator("cpu").manual_seed(0), **kw)
        sync(device)
        return since(t0), {}

    def naive():
        phases, t0 = {}, clock()
        steps = [("load", lambda: pipe.load_lora_weights(str(lib_dir / NAMES[0]), adapter_name="a",
                                                         weight_name="pytorch_lora_weights.safetensors")),
                 ("fuse", lambda: pipe.fuse_lora(lora_scale=0.8)),
                 ("run", lambda: pipe(generator=torch.Generator("cpu").manual_seed(0), **kw)),
                 ("unfuse", pipe.unfuse_lora), ("unload", pipe.unload_lora_weights)]
        for name, fn in steps:
            s = time.perf_counter()
            fn()
            sync(device)
            phases[name] = time.perf_counter() - s
        return since(t0), phases

    return base, naive


def flux_width_cases(work: Path, device, dtype, only=None):
    """(name -> callable giving seconds) for the FLUX.1-width blocks: base, 2 adapters unmerged and merged (the
    merged copies made once beforehand, as for a set that stays: their making is timed as ``merge_s``); ``only``:
    those names."""
    blocks, runtime, adapters = flux_width_blocks.build(work, device=device, dtype=dtype)
    x = blocks.inputs(device=device, dtype=dtype)
    m = merge.Merger(budget_bytes=64 << 30, mode="always")
    unmerged = merge.Merger(mode="never").plan([adapters])
    merged = m.plan([adapters], calls_left=10 ** 6)

    def call(plan):
        def fn():
            t0 = clock()
            with delta.active(plan):
                blocks(**x)
            sync(device)
            return since(t0)
        return fn

    fns = {"base": call(None), "warm-2": call(unmerged), "warm-2-merged": call(merged)}
    fns = {k: f for k, f in fns.items() if only is None or k in only}
    merge_s = call(merged)()[0] if "warm-2-merged" in fns else 0.0  # makes and keeps the merged copies
    return fns, merge_s, m.resident_bytes
