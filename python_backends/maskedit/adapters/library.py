"""The adapter library: a directory of adapters, each ``<name>/`` (Diffusers / PEFT: one ``.safetensors`` file,
e.g. ``pytorch_lora_weights.safetensors`` as ``save_lora_weights`` writes it) or ``<name>.safetensors`` (kohya /
A1111). Requests name adapters; a name is never a path, and only regular files directly in the directory (or in its
adapter subdirectories) are opened."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from maskedit_common.loras import FIELD, NAME, LoraRef, library_names
from maskedit_common.regular_files import NotRegularFile, open_regular

from ..errors import InvalidInput


@dataclass(frozen=True)
class AdapterFile:
    name: str
    path: Path  # the .safetensors file
    format: str  # "diffusers" (a directory) or "kohya" (a single file)
    digest: str  # sha256 prefix of the file's bytes

    @property
    def directory(self) -> Path:
        return self.path.parent


@dataclass(frozen=True)
class ResolvedRef:
    """One adapter of a request: its name, scale and the digest of the file it was checked against."""

    name: str
    scale: float
    digest: str

    def as_dict(self) -> dict:
        return {"name": self.name, "scale": self.scale, "digest": self.digest}


class AdapterLibrary:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._digests: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return library_names(self.root)

    def _locate(self, name: str) -> tuple[Path, str]:
        if not NAME.match(name):
            raise InvalidInput(f"adapter name {name!r:.60} is not an adapter name (names, not paths)", FIELD)
        root = self.root.resolve()
        d, f = root / name, root / f"{name}.safetensors"
        if d.is_dir():
            files = sorted(d.glob("*.safetensors"))
            if len(files) != 1:
                raise InvalidInput(f"adapter {name!r}: its directory holds {len(files)} .safetensors files, "
                                   "expected one", FIELD)
            path, fmt = files[0], "diffusers"
        elif f.is_file():
            path, fmt = f, "kohya"
        else:
            avail = ", ".join(self.names()) or "none"
            raise InvalidInput(f"unknown adapter {name!r}; available: {avail}", FIELD)
        real = path.resolve()
        if root not in real.parents:  # a symlink out of the library: never followed
            raise InvalidInput(f"adapter {name!r} is not inside the adapter library", FIELD)
        if not real.is_file():  # stat only: a FIFO, device or socket is refused without being opened
            raise InvalidInput(f"adapter {name!r}: {real.name} is not a regular file", FIELD)
        return real, fmt

    def file(self, name: str) -> AdapterFile:
        path, fmt = self._locate(name)
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            digest = self._digests.get(key)
        if digest is None:
            h = hashlib.sha256()
            try:
                with open_regular(path) as fh:  # a FIFO or device named *.safetensors never blocks the reader
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
            except NotRegularFile as e:
                raise InvalidInput(f"adapter {name!r}: {e}", FIELD) from None
            digest = h.hexdigest()[:16]
            with self._lock:
                self._digests[key] = digest
        return AdapterFile(name, path, fmt, digest)

    def resolve(self, refs: tuple[LoraRef, ...]) -> tuple[ResolvedRef, ...]:
        """Each named adapter checked to exist, with its file's digest (for the cache key and the denoiser, which
        refuses a file changed since)."""
        return tuple(ResolvedRef(r.name, r.scale, self.file(r.name).digest) for r in refs)
