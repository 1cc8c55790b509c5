"""What the Flux and UNet masked-block hooks share: attaching a hook to each block through Diffusers'
``HookRegistry``, the step context they read (per thread), and a recording's device-to-host copy stream."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
from diffusers.hooks import HookRegistry

from ..device import SideStream


class BlockHooks:
    """A hook on each of ``blocks`` (registered once per model, found again with ``of``) and the context a step
    runs them with. Subclasses say which blocks and which hook."""

    _ATTR = "_maskedit_cache_hooks"
    HOOK_NAME = "maskedit_masked_block"

    @classmethod
    def of(cls, model) -> "BlockHooks":
        """The hooks attached to ``model``, attaching them on first use (several runners and cache runtimes may
        share one model; each block carries the hook once)."""
        hooks = getattr(model, cls._ATTR, None)
        return hooks if hooks is not None else cls(model)

    def _attach(self, model, blocks: list, hook_cls) -> None:
        self.transformer = model
        self.blocks = blocks
        self._local = threading.local()
        for i, block in enumerate(blocks):
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook_cls(self, i), self.HOOK_NAME)
        object.__setattr__(model, self._ATTR, self)  # plain attribute: not a submodule of the model

    @property
    def context(self):
        return getattr(self._local, "ctx", None)

    # -- the tokens an entry holds rows of ----------------------------------------------------------------
    def reference_tokens(self, x) -> int:
        """Tokens the denoiser sees after the request's image tokens whose rows the cache records and reuses like
        those of unmasked tokens: an in-context edit model's reference image tokens (FLUX.2 [klein], FLUX.1
        Kontext; docs/caching.md, "Reference rows"). 0: none (the default)."""
        return 0

    def cache_mask(self, x) -> np.ndarray:
        """Per token an entry holds rows of (the request's image tokens, then its reference tokens): does the
        request edit it? Reference tokens never are edited: they are template context, and the key names their
        images."""
        own = np.asarray(x.token_mask, bool)
        r = self.reference_tokens(x)
        return np.concatenate([own, np.zeros(r, bool)]) if r else own

    def run(self, ctx, fn: Callable):
        """Call ``fn`` (the model's forward) with ``ctx`` active on this thread."""
        self._local.ctx = ctx
        try:
            return fn()
        finally:
            self._local.ctx = None

    def detach(self) -> None:
        for block in self.blocks:
            HookRegistry.check_if_exists_or_initialize(block).remove_hook(self.HOOK_NAME, recurse=False)
        if getattr(self.transformer, self._ATTR, None) is self:
            object.__delattr__(self.transformer, self._ATTR)


class RecordingStream:
    """A template run's copies to host memory: on a GPU on their own stream, after the kernels that produced the
    rows, so the step never waits for them; one event per finished step (followers' loads wait on it)."""

    def _start_recording(self, device) -> None:
        self.step = 0
        self._written: set = set()  # what was put so far: a step retried after a failure counts once
        self._out = SideStream.shared(device, "record")
        self._events: list = []  # per finished step: its copies' completion (None on the CPU)

    @property
    def writes(self) -> int:
        return len(self._written)

    def _copy_out(self, dst, src) -> None:
        with self._out.after():
            dst.copy_(src, non_blocking=True)
        self._out.keep_alive(src)

    def next_step(self) -> None:
        """The step's rows are all queued: mark them and move on."""
        self._events.append(self._out.mark())
        self.step += 1

    def step_event(self, step: int):
        """Completion of step ``step``'s copies (None on the CPU). Asking for a step not recorded yet is a bug in
        the caller (``JobCache.ready`` guards it): on a GPU it would read rows still in flight."""
        if step >= len(self._events):
            raise RuntimeError(f"step {step} has not been recorded yet ({len(self._events)} steps so far)")
        return self._events[step]

    def synchronize(self) -> None:
        if self._events and self._events[-1] is not None:
            self._events[-1].synchronize()
