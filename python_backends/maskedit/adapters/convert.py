"""An adapter file to per-module low-rank factors, by Diffusers' own loaders: the stock pipeline's
``lora_state_dict`` (with the family's converters: kohya / A1111, XLabs, ... keys to Diffusers keys), then what
``load_lora_adapter`` does before handing PEFT the state dict (the denoiser's prefix, ``convert_unet_state_dict_to_peft``,
ranks, ``_create_lora_config`` for alphas and patterns). The scaling of each module is PEFT's
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) so ``x·Aᵀ·Bᵀ·scaling·weight`` equals what a PEFT layer adds after
``set_adapters(names, weights)``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maskedit_common.loras import FIELD

from ..errors import InvalidInput
from .library import AdapterFile

# Key fragments of adapter types this server does not run (LyCORIS and friends): refused by name.
_UNSUPPORTED = {"hada_w1": "LyCORIS LoHa", "lokr_w1": "LyCORIS LoKr", ".lokr_": "LyCORIS LoKr",
                "oft_": "OFT", "dora_scale": "DoRA", "lora_magnitude_vector": "DoRA", ".diff": "full-weight diff",
                "glora_": "GLoRA", "ia3_": "IA3"}


@dataclass
class LoraModule:
    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r)
    alpha: float
    r: int
    rslora: bool = False

    def scaling(self, weight: float) -> float:
        """PEFT's ``LoraLayer.set_scale``, to the same floating-point expression."""
        if self.rslora:
            return weight * self.alpha / math.sqrt(self.r)
        return weight * self.alpha / self.r


@dataclass
class LoadedAdapter:
    name: str
    digest: str
    format: str
    modules: dict[str, LoraModule]  # denoiser module name -> factors

    @property
    def nbytes(self) -> int:
        return sum(m.A.numel() * m.A.element_size() + m.B.numel() * m.B.element_size() for m in self.modules.values())

    @property
    def ranks(self) -> list[int]:
        return sorted({m.r for m in self.modules.values()})


def _bad(name: str, what: str) -> InvalidInput:
    return InvalidInput(f"adapter {name!r}: {what}", FIELD)


def read_keys(f: AdapterFile) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(f.path), framework="pt") as fh:
            return list(fh.keys())
    except Exception as e:  # a header that does not parse: truncated, corrupt or not safetensors
        raise _bad(f.name, f"the file is corrupt or truncated ({type(e).__name__}: {str(e)[:120]})") from None


def load(f: AdapterFile, family, denoiser, device=None, dtype=None) -> LoadedAdapter:
    """Read and convert ``f`` for ``denoiser`` (the family's, as served). Errors name ``LORAS`` and the adapter."""
    from diffusers.utils.peft_utils import _create_lora_config
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft
    from peft.utils.other import get_pattern_key

    keys = read_keys(f)
    for frag, kind in _UNSUPPORTED.items():
        if any(frag in k for k in keys):
            raise _bad(f.name, f"unsupported adapter type ({kind}); LoRA files in Diffusers/PEFT or kohya format "
                       "are served")
    pipe_cls = family.pipeline_class()
    try:
        out = pipe_cls.lora_state_dict(str(f.directory), weight_name=f.path.name, return_lora_metadata=True,
                                       local_files_only=True, **family.lora_loader_kwargs(denoiser))
    except Exception as e:
        raise _bad(f.name, f"not a LoRA Diffusers can read for {family.pipeline_class_name} "
                   f"({type(e).__name__}: {str(e)[:160]})") from None
    state_dict, alphas, metadata = out if len(out) == 3 else (out[0], None, out[-1])
    if not state_dict or not all("lora" in k for k in state_dict):
        raise _bad(f.name, "not a LoRA checkpoint (keys without 'lora')")
    prefix = family.lora_prefix()
    own = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
    other = sorted({k.split(".")[0] for k in state_dict if not k.startswith(f"{prefix}.")})
    if other:
        raise _bad(f.name, f"has layers for {', '.join(other)}; only {prefix} layers are served (text-encoder "
                   "LoRA is not supported)")
    if metadata:
        metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items()}
    if not own:
        raise _bad(f.name, f"has no {prefix} layers")
    if "lora_A" not in next(iter(own)):
        own = convert_unet_state_dict_to_peft(own)
    rank = {f"^{k}": v.shape[1] for k, v in own.items() if "lora_B" in k and v.ndim > 1}
    if alphas:
        alphas = {k.removeprefix(f"{prefix}."): v for k, v in alphas.items() if k.startswith(f"{prefix}.")}
    try:
        config = _create_lora_config(own, alphas or None, metadata or None, rank,
                                     model_state_dict=None, adapter_name=f.name)
    except Exception as e:
        raise _bad(f.name, f"its ranks and alphas do not form a LoRA config ({str(e)[:160]})") from None
    if config.use_dora:
        raise _bad(f.name, "unsupported adapter type (DoRA)")
    p = next(denoiser.parameters())
    device, dtype = device or p.device, dtype or p.dtype
    modules: dict[str, LoraModule] = {}
    for key in own:
        if ".lora_A." not in key:
            if ".lora_B." in key and key.endswith(".bias"):
                raise _bad(f.name, "LoRA bias terms are not supported")
            continue
        target = key.split(".lora_A.")[0]
        A, B = own[key], own.get(f"{target}.lora_B.weight")
        if B is None:
            raise _bad(f.name, f"module {target} has lora_A but no lora_B")
        try:
            mod = denoiser.get_submodule(target)
        except AttributeError:
            raise _bad(f.name, f"made for another model: this {family.pipeline_class_name} denoiser has no module "
                       f"{target!r}") from None
        if not isinstance(mod, torch.nn.Linear):
            raise _bad(f.name, f"module {target} is a {type(mod).__name__}; only linear layers are supported")
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != mod.in_features or B.shape[0] != mod.out_features \
                or A.shape[0] != B.shape[1]:
            raise _bad(f.name, f"mismatched shapes at {target}: A {tuple(A.shape)}, B {tuple(B.shape)} for a "
                       f"{mod.in_features}->{mod.out_features} layer (made for another model?)")
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), target), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), target), config.lora_alpha)
        if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
            raise _bad(f.name, f"non-finite weights at {target}")
        modules[target] = LoraModule(A.to(device, dtype).contiguous(), B.to(device, dtype).contiguous(),
                                     float(alpha), int(r), bool(config.use_rslora))
    if not modules:
        raise _bad(f.name, "has no LoRA layers")
    return LoadedAdapter(f.name, f.digest, f.format, modules)
