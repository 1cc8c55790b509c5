"""The ControlNet library: a directory of ControlNets, each ``<name>/`` as ``save_pretrained`` writes it
(``config.json`` + weights). Requests name ControlNets; a name is never a path, and only directories directly in the
library are opened (a symlink out of it is refused), and in them only regular files (``maskedit_common.regular_files``:
a FIFO, device or socket named like a ControlNet file is refused, naming CONTROLS, before anything waits on it).
Loaded models are cached by name and the files' mtimes, and shared by every request naming them."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

from maskedit_common.controls import FIELD, NAME, UNION_MODES, ControlSpec, library_names
from maskedit_common.regular_files import NotRegularFile, check_regular_dir, read_regular

from ..errors import InvalidInput


class ControlNetLibrary:
    def __init__(self, root: str | Path, family, settings):
        self.root = Path(root)
        self.family = family
        self.settings = settings
        self._models: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return library_names(self.root)

    def path(self, name: str, index: int = 0) -> Path:
        """The ControlNet directory of ``name``, inside the library, or ``InvalidInput`` naming CONTROLS."""
        if not NAME.match(name):
            raise InvalidInput(f"control {index}: {name!r:.60} is not a ControlNet name (names, not paths)", FIELD)
        root = self.root.resolve()
        d = root / name
        if not (d / "config.json").exists():
            avail = ", ".join(self.names()) or "none"
            raise InvalidInput(f"control {index}: unknown ControlNet {name!r}; available: {avail}", FIELD)
        real = d.resolve()
        if root not in real.parents:
            raise InvalidInput(f"control {index}: ControlNet {name!r} is not inside the ControlNet library", FIELD)
        try:  # every file the loader would open by name: stat only, nothing opened
            check_regular_dir(real)
        except NotRegularFile as e:
            raise InvalidInput(f"control {index}: ControlNet {name!r}: {e}", FIELD) from None
        return real

    def config(self, name: str, index: int = 0) -> dict:
        return self._read_config(self.path(name, index), name, index)

    @staticmethod
    def _read_config(path: Path, name: str, index: int) -> dict:
        try:  # checked on the open file too: what is read is what was checked
            return json.loads(read_regular(path / "config.json"))
        except NotRegularFile as e:
            raise InvalidInput(f"control {index}: ControlNet {name!r}: {e}", FIELD) from None

    def check(self, specs: tuple[ControlSpec, ...]) -> None:
        """What can be told from the configs alone (pre-processing: no weights loaded): each name exists, is a
        ControlNet this family runs, and takes a mode exactly when it is a union model."""
        for i, spec in enumerate(specs):
            self._check_config(spec, self.config(spec.name, i), i)

    def _check_config(self, spec: ControlSpec, cfg: dict, i: int) -> None:
        cls = cfg.get("_class_name")
        fam = self.family
        if cls not in fam.controlnet_classes:
            runs = ", ".join(fam.controlnet_classes) or "no ControlNets"
            raise InvalidInput(f"control {i}: ControlNet {spec.name!r} is a {cls}, for another model family; "
                               f"{fam.pipeline_class_name} models run {runs}", FIELD)
        union = fam.controlnet_union(cfg)
        if union and spec.mode is None:
            raise InvalidInput(f"control {i}: ControlNet {spec.name!r} is a union ControlNet; give its \"mode\" "
                               f"({', '.join(UNION_MODES)})", FIELD)
        if not union and spec.mode is not None:
            raise InvalidInput(f"control {i}: ControlNet {spec.name!r} takes no \"mode\" (not a union ControlNet)",
                               FIELD)
        if union:
            try:
                fam.control_mode_index(spec.mode, cfg)
            except ValueError as e:
                raise InvalidInput(f"control {i}: ControlNet {spec.name!r}: {e}", FIELD) from None

    def check_remote(self, spec: ControlSpec, index: int = 0, denoiser=None) -> None:
        """What ``load`` checks, from the config alone (the ``controlnet`` model loads the weights): None."""
        cfg = self.config(spec.name, index)
        self._check_config(spec, cfg, index)
        if denoiser is not None:
            try:
                self.family.check_controlnet(SimpleNamespace(config=SimpleNamespace(**cfg)), denoiser)
            except ValueError as e:
                raise InvalidInput(f"control {index}: ControlNet {spec.name!r} {e}", FIELD) from None

    def load(self, spec: ControlSpec, index: int = 0, denoiser=None):
        """The loaded ControlNet of ``spec`` (cached), checked against the family and ``denoiser``."""
        path = self.path(spec.name, index)
        self._check_config(spec, self._read_config(path, spec.name, index), index)
        stamp = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in path.iterdir() if p.is_file()))
        key = (spec.name, stamp)
        with self._lock:
            model = self._models.get(key)
            if model is None:
                try:
                    model = self.family.load_controlnet(path, self.settings)
                    if denoiser is not None:
                        self.family.check_controlnet(model, denoiser)
                except ValueError as e:
                    raise InvalidInput(f"control {index}: ControlNet {spec.name!r} {e}", FIELD) from None
                self._models = {k: v for k, v in self._models.items() if k[0] != spec.name}  # drop a stale version
                self._models[key] = model
        return model
