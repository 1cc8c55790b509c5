"""Adding and removing LoRA adapters at runtime (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

Every backend instance reads adapters from the one library directory (``MASKEDIT_LORA_DIR``) by name, on each
request. So loading is installing: the adapter at ``lora_path`` (inside one of ``MASKEDIT_LORA_ROOTS``, symlinks
resolved; nothing else is opened) is copied into the library as ``<lora_name>/`` through a hidden staging
directory and one atomic rename, and every instance, every model process and ``/v1/models`` see it on their next
look; unloading renames it out (into hidden staging) and deletes it. Only adapters installed this way carry the
marker file ``.runtime-adapter.json`` and may be unloaded: the files an operator put in the library stay. Only
regular files are opened (``maskedit_common.regular_files``: a FIFO, device or socket named ``*.safetensors`` is
refused without blocking). An adapter is answered 200 only once it is fully checked: its safetensors header read
here (what is plainly not an adapter is refused at once), then the staged copy run through the backends' own loader
against the served model (``ChildCheck``: every tensor parsed, each module's shape checked against the family's
denoiser, finite weights), so a truncated file or one made for another model is refused naming ``lora_path`` instead
of failing at its first use. Writers on one host serialise on a lock file in the library; router replicas on other
hosts need the library on a shared volume (docs/lora.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from maskedit_common.loras import NAME, library_names
from maskedit_common.regular_files import NotRegularFile, open_regular

MARKER = ".runtime-adapter.json"  # not a .safetensors file: the backends' library ignores it
LOCK = ".adapters.lock"
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class AdminError(Exception):
    """A refused load or unload: the HTTP status, the message and the body field it is about."""

    def __init__(self, status: int, message: str, param: str | None):
        super().__init__(message)
        self.status, self.param = status, param


def _bad(param: str, message: str, status: int = 400) -> AdminError:
    return AdminError(status, f"{param}: {message}", param)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _copy(fh, dest: Path) -> str:
    """Copy the open file ``fh`` from its start to ``dest``; the sha256 of what was copied."""
    h = hashlib.sha256()
    fh.seek(0)
    with open(dest, "wb") as out:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)
    return h.hexdigest()


def _check_header(fh, path: Path) -> None:
    """The open file ``fh`` is a safetensors file whose tensors include LoRA factors (``ChildCheck`` does the rest)."""
    head = fh.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    raw = fh.read(n) if 0 < n <= MAX_HEADER else b""
    try:
        keys = [k for k in json.loads(raw) if k != "__metadata__"] if len(raw) == n else None
    except (UnicodeDecodeError, ValueError):
        keys = None
    if keys is None:
        raise _bad("lora_path", f"{path.name} is not a safetensors file (its header does not parse)")
    if not any("lora" in k.lower() for k in keys):
        raise _bad("lora_path", f"{path.name} holds no LoRA weights (no tensor name contains 'lora')")


class ChildCheck:
    """The full check of an adapter file: the backends' loader run on it in a child process
    (``python -m maskedit.adapters.check``, the image ships it) with the router's settings (``MASKEDIT_MODEL_DIR``
    names the served model, hence the family and the shapes). Answers are kept by the file's sha256: the same bytes
    are checked once. Fails closed: no answer (the check cannot run here, or took longer than ``timeout_s``) refuses
    the load."""

    COMMAND = (sys.executable, "-m", "maskedit.adapters.check")

    def __init__(self, command=COMMAND, timeout_s: float = 300.0):
        self.command, self.timeout_s = tuple(command), timeout_s
        self._known: dict[str, str | None] = {}  # sha256 -> None (a good adapter) or why not
        self._lock = threading.Lock()

    def __call__(self, path: Path, digest: str) -> None:
        """Raises ``AdminError`` (400 naming ``lora_path`` for a bad adapter, 503 when it cannot be checked)."""
        with self._lock:
            known = self._known.get(digest, ...)
        if known is ...:
            known = self._run(path)
            with self._lock:
                self._known[digest] = known
        if known is not None:
            raise _bad("lora_path", f"{path.name} is not an adapter the served model can run: {known}")

    def _run(self, path: Path) -> str | None:
        try:
            p = subprocess.run([*self.command, str(path)], capture_output=True, text=True, timeout=self.timeout_s,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise AdminError(503, f"the adapter check did not finish within {self.timeout_s:g} s; load it again",
                             None) from None
        except OSError as e:
            raise AdminError(503, f"the adapter check cannot run here ({e.strerror})", None) from None
        try:
            out = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise AdminError(503, f"the adapter check failed to run (exit {p.returncode}: {tail})", None) from None
        return None if out.get("ok") else str(out.get("error", "rejected"))[:400]


class AdapterAdmin:
    """Installs adapters from ``roots`` into the library ``library``; ``reserved`` names are the base models';
    ``check`` (path, sha256) -> None or raises ``AdminError``: the full check of a staged adapter (``ChildCheck``)."""

    def __init__(self, library: Path, roots=(), reserved=(), check: Callable[[Path, str], None] | None = None):
        self.library, self.roots, self.reserved = Path(library), tuple(Path(r) for r in roots), set(reserved)
        self.check = check or ChildCheck()

    # -- checks ---------------------------------------------------------------------------------------
    def _name(self, name) -> str:
        if not isinstance(name, str) or not NAME.match(name):
            raise _bad("lora_name", f"{str(name)[:60]!r} is not an adapter name (letters, digits, '.', '_', '-'; "
                       "at most 128)")
        if name in self.reserved:
            raise _bad("lora_name", f"{name!r} is the base model's name")
        return name

    def source(self, lora_path) -> Path:
        """The adapter's ``.safetensors`` file at ``lora_path`` (a directory holding one, or the file), resolved,
        inside a configured root and a regular file, or a 400 naming ``lora_path``. Only path names and ``stat`` are
        looked at: nothing is opened."""
        if not isinstance(lora_path, str) or not lora_path.strip() or "\x00" in lora_path:
            raise _bad("lora_path", "must be a path to an adapter directory or .safetensors file")
        if not self.roots:
            raise _bad("lora_path", "runtime adapter loading is off: no source directories are configured "
                       "(MASKEDIT_LORA_ROOTS)")
        roots = [r.resolve() for r in self.roots]
        p = Path(lora_path)
        real = (p if p.is_absolute() else roots[0] / p).resolve()
        inside = lambda q: any(q == r or r in q.parents for r in roots)  # noqa: E731
        if not inside(real):
            raise _bad("lora_path", f"{lora_path[:200]!r} is not inside the adapter source directories "
                       f"({', '.join(str(r) for r in self.roots)})")
        if real.is_dir():
            files = sorted(real.glob("*.safetensors"))
            if len(files) != 1:
                raise _bad("lora_path", f"{lora_path[:200]!r} holds {len(files)} .safetensors files, expected one")
            real = files[0].resolve()
            if not inside(real):
                raise _bad("lora_path", f"{files[0].name} in {lora_path[:200]!r} links outside the adapter source "
                           "directories")
        elif not (real.is_file() and real.suffix == ".safetensors"):
            raise _bad("lora_path", f"{lora_path[:200]!r} is not an adapter directory or .safetensors file"
                       + ("" if real.exists() else " (it does not exist)"))
        if not real.is_file():  # a FIFO, device or socket named *.safetensors in an adapter directory
            raise _bad("lora_path", f"{real.name} in {lora_path[:200]!r} is not a regular file")
        return real

    # -- the two endpoints ----------------------------------------------------------------------------
    def load(self, body) -> dict:
        if not isinstance(body, dict):
            raise AdminError(400, 'the body must be a JSON object {"lora_name": ..., "lora_path": ...}', None)
        name = self._name(body.get("lora_name"))
        src = self.source(body.get("lora_path"))
        with self._locked():
            stage = self.library / f".staging-{name}-{uuid.uuid4().hex[:8]}"
            stage.mkdir()
            try:
                try:
                    with open_regular(src) as fh:  # checked on the open file: what is read is what was checked
                        _check_header(fh, src)
                        digest = _copy(fh, stage / src.name)  # the staged bytes are the ones hashed and checked
                except NotRegularFile as e:
                    raise _bad("lora_path", str(e)) from None
                except OSError as e:
                    raise _bad("lora_path", f"{src.name} cannot be read ({e.strerror})") from None
                existing = self._installed_digest(name)
                if existing is not None:
                    if existing == digest:
                        return {"lora_name": name, "status": "already loaded", "digest": digest[:16]}
                    raise _bad("lora_name", f"adapter {name!r} exists with other weights; unload it first (or pick "
                               "another name)")
                self.check(stage / src.name, digest)  # fully: parsed, shapes against the served model
                (stage / MARKER).write_text(json.dumps({"name": name, "source": str(src), "sha256": digest,
                                                        "loaded_at": time.time()}))
                try:
                    os.rename(stage, self.library / name)  # atomic: the backends see all of it or none of it
                except OSError:
                    raise _bad("lora_name", f"the library holds an entry {name!r} that is not an adapter") from None
            finally:
                if stage.exists():
                    shutil.rmtree(stage, ignore_errors=True)
        return {"lora_name": name, "status": "loaded", "digest": digest[:16]}

    def unload(self, body) -> dict:
        if not isinstance(body, dict):
            raise AdminError(400, 'the body must be a JSON object {"lora_name": ...}', None)
        name = self._name(body.get("lora_name"))
        with self._locked():
            d = self.library / name
            if name not in library_names(self.library):
                raise _bad("lora_name", f"no adapter {name!r} is loaded; loaded: "
                           f"{', '.join(library_names(self.library)) or 'none'}", 404)
            if not (d.is_dir() and not d.is_symlink() and (d / MARKER).is_file()):
                raise _bad("lora_name", f"adapter {name!r} is part of the library directory (placed there, not "
                           "loaded at runtime): remove its files to retire it")
            gone = self.library / f".unloading-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(d, gone)  # atomic: no request finds it from here on
            shutil.rmtree(gone, ignore_errors=True)
        return {"lora_name": name, "status": "unloaded"}

    def _installed_digest(self, name: str) -> str | None:
        """The sha256 of the library's adapter ``name``, None if it has none."""
        if name not in library_names(self.library):
            return None
        d = self.library / name
        files = sorted(d.glob("*.safetensors")) if d.is_dir() else [self.library / f"{name}.safetensors"]
        real = files[0].resolve() if len(files) == 1 else None
        lib = self.library.resolve()
        try:
            return _sha256(real) if real is not None and lib in real.parents else "unreadable"
        except OSError:  # not a regular file (a FIFO placed in the library), or unreadable
            return "unreadable"

    @contextmanager
    def _locked(self):
        if not self.library.is_dir():
            raise AdminError(500, f"the adapter library {self.library} is not a directory", None)
        try:
            fh = open(self.library / LOCK, "a")
        except OSError as e:
            raise AdminError(500, f"the adapter library is not writable ({e.strerror})", None) from None
        with fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
