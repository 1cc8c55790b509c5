"""What a cache entry is valid for.

The unmasked tokens' activations depend on the model (identity and weights version), the template's
pixels, the resolution the model runs at, the number of steps and the scheduler's settings (the timestep
schedule), the guidance (embedded in every block's modulation), the seed of the unmasked tokens' noise
(``TEMPLATE_SEED``, which also seeds the VAE sampling of the template) and the compute dtype. All of it
goes into the key; a request whose settings differ misses and runs in full (and records a new entry).

Not in the key, by design (InstGenIE's approximation): the prompt and the mask. Unmasked activations are
reused across prompts and masks of the same template; tokens the recording request itself edited are
marked invalid in the entry and are always recomputed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


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
              template_seed: int, scheduler_config: dict, dtype: str, adapters=()) -> str:
    """``adapters``: the request's LoRA set, (name, scale, file digest) each: activations recorded under one set
    are never valid under another (none: the key of a plain request, unchanged)."""
    fields = {
        "model": fingerprint, "template": template_hash, "size": [model_w, model_h], "steps": steps,
        "guidance": round(float(guidance), 6), "template_seed": int(template_seed), "dtype": dtype,
        "scheduler": {k: v for k, v in sorted(scheduler_config.items()) if not k.startswith("_")},
    }
    if adapters:
        fields["adapters"] = [[str(n), round(float(s), 6), str(d)] for n, s, d in adapters]
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:40]
