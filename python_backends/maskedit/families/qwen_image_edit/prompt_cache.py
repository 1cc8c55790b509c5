"""Encoded prompts per (prompt, reference image), kept by pre-processing: an LRU bounded in bytes.

Qwen-Image-Edit encodes the prompt with a vision-language model that reads the template too (7B parameters and
~1.4k image tokens at 1 MP in production), so the encoding depends on both. Edits of one template repeat prompts
(the negative prompt of classifier-free guidance on every request; a retried or re-seeded edit), and a hit skips
the encoder entirely. The key holds the prompt text and a digest of the encoder's image (its pixels and size), so
two templates never share an entry. The values are the encoder's output as it returned them (not copied: nothing
downstream writes to them).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable

import torch


def image_digest(image) -> str:
    """A digest of a PIL image's pixels and size."""
    h = hashlib.blake2b(image.tobytes(), digest_size=16)
    h.update(f"{image.mode}{image.size}".encode())
    return h.hexdigest()


class EncodedPrompts:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, text: str, image, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``text``'s embeddings with ``image``: from the cache, else ``encode()`` (kept if it fits the budget)."""
        key = (text, image_digest(image))
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return got
            self.misses += 1
        value = encode()  # outside the lock: another request's lookup need not wait for the encoder
        size = value.numel() * value.element_size()
        with self._lock:
            if size <= self.max_bytes and key not in self._entries:
                self._entries[key] = value
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.numel() * old.element_size()
        return value

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
