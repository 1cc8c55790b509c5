"""What a cache entry is valid for.

The unmasked tokens' activations depend on the model (identity and weights version), the template's
pixels, the resolution the model runs at, the number of steps and the scheduler's settings (the timestep
schedule), the guidance (embedded in every block's modulation), the seed of the unmasked tokens' noise
(``TEMPLATE_SEED``, which also seeds the VAE sampling of the template) and the compute dtype. All of it
goes into the key; a request whose settings differ misses and runs in full (and records a new entry).

STRENGTH (a schedule starting at a later step) is in it through its first step, except for families whose pipeline
blends the template back outside the mask every step: there an entry recorded from an earlier step serves it
(docs/caching.md, "Strength"). PADDING_MASK_CROP is, through the crop box.

Not in the key, by design (InstGenIE's approximation): the prompt and the mask. Unmasked activations are
reused across prompts and masks of the same template; tokens the recording request itself edited are
marked invalid in the entry and are always recomputed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from maskedit_common.regular_files import read_regular


def model_fingerprint(model_dir: Path, version: str = "") -> str:
    """Configs plus the name, size and mtime of every weight file, and ``version`` (``Settings.model_version``,
    MASKEDIT_MODEL_VERSION), which can pin it."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    for rel in ("model_index.json", "transformer/config.json", "scheduler/scheduler_config.json",
                "vae/config.json"):
        p = model_dir / rel
        if p.exists():
            h.update(rel.encode() + p.read_bytes())
    for p in sorted(model_dir.rglob("*.safetensors")) + sorted(model_dir.rglob("*.bin")):
        st = p.stat()
        h.update(f"{p.relative_to(model_dir)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(version.encode())
    return h.hexdigest()[:16]


def cache_key(fingerprint: str, template_hash: str, model_w: int, model_h: int, steps: int, guidance: float,
              template_seed: int, scheduler_config: dict, dtype: str, adapters=(), controls=(),
              references=(), crop=None, first_step: int = 0) -> str:
    """``adapters``: the request's LoRA set, (name, scale, file digest) each: activations recorded under one set
    are never valid under another (none: the key of a plain request, unchanged). ``controls``: its ControlNets in
    order, ``control_identity`` each: the residuals change every block's input, so no two control sets share.
    ``references``: its reference images in order (``image_digest`` each), beyond the template: an in-context edit
    model attends to their tokens, and their rows are the entry's (reference rows).
    ``crop``: PADDING_MASK_CROP's (x1, y1, x2, y2) of the template: the model's template is that crop.
    ``first_step``: STRENGTH's first step where the unmasked tokens' trajectory depends on it (0: none, or a family
    that blends the template back every step: docs/caching.md, "Strength")."""
    fields = {
        "model": fingerprint, "template": template_hash, "size": [model_w, model_h], "steps": steps,
        "guidance": round(float(guidance), 6), "template_seed": int(template_seed), "dtype": dtype,
        "scheduler": {k: v for k, v in sorted(scheduler_config.items()) if not k.startswith("_")},
    }
    if adapters:
        fields["adapters"] = [[str(n), round(float(s), 6), str(d)] for n, s, d in adapters]
    if controls:
        fields["controls"] = [list(c) for c in controls]
    if references:
        fields["references"] = [str(r) for r in references]
    if crop is not None:
        fields["crop"] = [int(v) for v in crop]
    if first_step:
        fields["first_step"] = int(first_step)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:40]


def dir_digest(path: Path) -> str:
    """A model directory's identity: its configs' bytes and its weight files' names, sizes and mtimes (as
    ``model_fingerprint``)."""
    h = hashlib.sha256()
    for p in sorted(Path(path).iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(read_regular(p) if p.suffix == ".json" else f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def image_digest(img) -> str:
    """A control image's identity: its size and RGB bytes (a PIL image)."""
    rgb = img.convert("RGB")
    return hashlib.sha256(f"{rgb.size}".encode() + rgb.tobytes()).hexdigest()[:32]


def control_identity(spec, weights_digest: str, image_digest: str) -> tuple:
    """What a control's residuals depend on: its ControlNet (name, weights), its image (after any preprocessor),
    its scale, [start, end] window and union mode."""
    return (str(spec.name), str(weights_digest), str(image_digest), round(float(spec.scale), 6),
            round(float(spec.start), 6), round(float(spec.end), 6), spec.mode or "")
