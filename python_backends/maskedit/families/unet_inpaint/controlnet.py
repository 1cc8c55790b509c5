"""ControlNets for SD 2 / SDXL inpainting, as ``StableDiffusionXLControlNetInpaintPipeline`` (and the SD 2
``StableDiffusionControlNetInpaintPipeline``) run them with the 9-channel inpainting UNet: per step each ControlNet
sees the request's scaled latents (4 channels, before the mask channels are concatenated), its timestep, its text
rows and SDXL conditioning — every classifier-free-guidance row, the control image repeated per row (guess mode
off) — and returns residuals scaled by its conditioning scale at this step (``controlnet_keep``). A request's
ControlNets are summed in order (``MultiControlNetModel``); the UNet adds the sums to its down and mid blocks.
Union ControlNets (``ControlNetUnionModel``) take the control image in their mode's slot and the mode as a one-hot
``control_type``, as ``StableDiffusionXLControlNetUnionInpaintPipeline`` passes them.

In a batched UNet call, requests without active controls get zero residual rows (the pipelines add zeros too when
a control's scale is 0 outside its start / end), so their rows equal their run alone.

Cached (``UNetInpaint.controls_in_masked_path``): a ControlNet is the UNet's down path and mid block, so its
transformer blocks take the UNet's mask-aware hooks (``cache.UNetCacheHooks``) and each control its own entry
(``maskedit.cache.controlnet``); ``control_residuals`` makes its call with the control's cache view.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

CONTROLNET_CLASSES = ("ControlNetModel", "ControlNetUnionModel")
UNION_CLASSES = ("ControlNetUnionModel",)
_MATCH = ("cross_attention_dim", "addition_embed_type", "block_out_channels", "projection_class_embeddings_input_dim")
UNION_MODES = 8  # control types of the tiny union ControlNet (xinsir's promax numbering: 0 pose .. 7 repaint)


def check_controlnet(controlnet, unet) -> None:
    """The ControlNet's residuals must fit the UNet: same widths and conditioning, 4 latent input channels."""
    cfg, ucfg = controlnet.config, unet.config
    if cfg.in_channels != 4:
        raise ValueError(f"takes {cfg.in_channels} input channels; an inpainting UNet's ControlNet takes the 4 "
                         "latent channels")
    for k in _MATCH:
        a, b = getattr(cfg, k, None), getattr(ucfg, k, None)
        if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            raise ValueError(f"has {k} {a} but this model's UNet has {b}: a ControlNet for another model")


def prepare_control_image(pipe, image, w: int, h: int, device, crop=None) -> torch.Tensor:
    """(3, h, w) in [0, 1]: the ControlNet pipelines' ``prepare_control_image`` (their ``control_image_processor``,
    no normalisation) for one image, no guidance doubling. ``crop`` (PADDING_MASK_CROP's box in the template's
    pixels): as the SD / SDXL (union) ControlNet inpaint pipelines pass it, ``crops_coords`` with ``resize_mode``
    "fill": the control image is cropped at those pixel coordinates (of its own frame, whatever its size), then
    resized to the model size."""
    from diffusers import StableDiffusionXLControlNetInpaintPipeline
    from diffusers.image_processor import VaeImageProcessor

    shim = SimpleNamespace(control_image_processor=VaeImageProcessor(
        vae_scale_factor=pipe.vae_scale_factor, do_convert_rgb=True, do_normalize=False))
    img = StableDiffusionXLControlNetInpaintPipeline.prepare_control_image(
        shim, image, w, h, 1, 1, device, torch.float32, None if crop is None else tuple(crop),
        "default" if crop is None else "fill", False, False)
    return img[0]


def control_residuals(control, inputs: dict, scale: float) -> list[torch.Tensor]:
    """One ControlNet call for one request's rows; ``inputs``: ``sample`` (R, 4, h, w) scaled latents, ``timestep``
    (R,), ``encoder_hidden_states`` (R, 77, D), ``added_cond_kwargs`` (SDXL) or None, and where the request's
    ControlNets are cached ``cached`` (``step.cached_controls``). Returns the down residuals then the mid residual,
    scaled."""
    model, rows = control.model, inputs["sample"].shape[0]
    image = control.image.unsqueeze(0).expand(rows, -1, -1, -1)
    kw = dict(encoder_hidden_states=inputs["encoder_hidden_states"], conditioning_scale=scale, guess_mode=False,
              added_cond_kwargs=inputs.get("added_cond_kwargs"), return_dict=False)
    if type(model).__name__ in UNION_CLASSES:
        mode = control.spec.mode_index
        control_type = torch.zeros(model.config.num_control_type).scatter_(0, torch.tensor([mode]), 1)
        kw.update(controlnet_cond=[image], control_type=control_type.reshape(1, -1).to(
            image.device, inputs["encoder_hidden_states"].dtype).repeat(rows, 1), control_type_idx=[mode])
    else:
        kw.update(controlnet_cond=image)
    call = lambda: model(inputs["sample"], inputs["timestep"], **kw)  # noqa: E731
    cached = inputs.get("cached")  # its cache view: a template run's recording or a hit's masked rows
    down, mid = cached(control, call) if cached is not None else call()
    return [*down, mid]


def start_residuals(provider, group: list, steps_inputs: list[dict]) -> list:
    """Start each request's ControlNet calls for this step (``provider``: ``controlnets.provider``; in-process it
    computes them now, through Triton they are in flight on return): one ``Pending`` or None per request."""
    pending = []
    for job, inputs in zip(group, steps_inputs):
        active = [(c, c.scale_for(job)) for c in job.controls]
        active = [(c, s) for c, s in active if s != 0]  # outside its start / end: the pipelines add its zeros
        pending.append(provider.start(job, active, inputs) if active else None)
    return pending


def collect_residuals(provider, group: list, pending: list, t0: float):
    """The UNet's ``down_block_additional_residuals`` and ``mid_block_additional_residual`` for ``group`` from
    ``start_residuals``' calls, or (None, None) when no request has an active control at this step. Requests whose
    call failed raise one ``ControlNetFailed`` naming them all (the engine fails those alone)."""
    from ...controlnets.provider import ControlNetFailed

    per_job, failed = [], []
    for job, p in zip(group, pending):
        try:
            per_job.append(None if p is None else p.result())
        except ControlNetFailed as e:
            failed.append(e)
            per_job.append(None)
        if p is not None:
            job.control_s += p.seconds
            job.control_bls_s += p.bls_s
            job.control_model_s += p.model_s
    if any(p is not None for p in pending):
        provider.stats.add(steps=1, step_s=time.perf_counter() - t0)
    if failed:
        raise ControlNetFailed(str(failed[0]).removeprefix("CONTROLS: "), [f for e in failed for f in e.failures])
    shapes = next((t for t in per_job if t is not None), None)
    if shapes is None:
        return None, None
    rows = [t if t is not None else [torch.zeros_like(x) for x in shapes] for t in per_job]
    summed = [torch.cat(parts) for parts in zip(*rows)]
    return summed[:-1], summed[-1]


class LateResiduals:
    """Residuals handed to the UNet before they exist, so its work that does not need them overlaps the ControlNet
    calls: ``UNet2DConditionModel.forward`` reads ``down_block_additional_residuals`` only after its time embedding,
    ``conv_in`` and every down block (it zips them with the down blocks' outputs), and the mid residual after its mid
    block. ``down`` resolves the calls when first iterated and copies the mid residual into ``mid``, a placeholder
    of the mid block's output shape (the last down block's: ``block_out_channels[-1]`` at 1 / 2^(blocks-1) size)."""

    def __init__(self, resolve, unet, rows: int, h: int, w: int, device, dtype):
        for _ in range(len(unet.config.block_out_channels) - 1):
            h, w = (h + 1) // 2, (w + 1) // 2  # stride-2 convolutions with padding 1
        self.mid = torch.zeros(rows, unet.config.block_out_channels[-1], h, w, device=device, dtype=dtype)
        self._resolve, self._down = resolve, None
        self.down = self

    def __iter__(self):
        if self._down is None:
            down, mid = self._resolve()
            self.mid.copy_(mid)
            self._down = down
        return iter(self._down)


def group_residuals(provider, group: list, steps_inputs: list[dict]):
    """``start_residuals`` then ``collect_residuals``: nothing done in between."""
    t0 = time.perf_counter()
    return collect_residuals(provider, group, start_residuals(provider, group, steps_inputs), t0)


def build_controlnets(model_dir: Path, out: Path, seed: int = 0) -> list[Path]:
    """Seeded random ControlNets for the UNet in ``model_dir``: ``canny`` and ``depth`` (``ControlNetModel``) and,
    for SDXL, ``union`` (``ControlNetUnionModel``, 8 modes), each the UNet's layout (its widths, blocks, text and SDXL
    conditioning) with 4 latent input channels, built with ``from_unet`` from a weightless copy of the UNet's config
    and written with ``save_pretrained``. The zero-initialised output convolutions get visible random weights."""
    from diffusers import ControlNetModel, ControlNetUnionModel, UNet2DConditionModel

    cfg = dict(UNet2DConditionModel.load_config(model_dir, subfolder="unet"))
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config({**cfg, "in_channels": 4})
    widths = tuple(cfg["block_out_channels"])
    embed = (8, 16, widths[0] // 2, widths[0])  # the control image down to latent size (3 halvings, like 16..256)
    out = Path(out)
    written = []
    names = ("canny", "depth", "union") if cfg.get("addition_embed_type") == "text_time" else ("canny", "depth")
    for i, name in enumerate(names):  # the union model is SDXL's (its mode embedding uses the time-id width)
        torch.manual_seed(seed * 100 + i + 1)
        model = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=embed,
                                          load_weights_from_unet=False)
        if name == "union":  # the same layout plus the union's mode embedding and transformer, at the UNet's width
            base = {k: v for k, v in model.config.items() if k != "mid_block_type"}  # the union has one kind
            model = ControlNetUnionModel.from_config({
                **base, "num_control_type": UNION_MODES, "num_trans_channel": widths[0],
                "num_trans_head": 2, "num_proj_channel": widths[0]})
        with torch.no_grad():
            for p in model.parameters():
                if p.abs().sum() == 0:  # zero convolutions and the like: visible residuals, as trained weights give
                    p.normal_(0.0, 0.05)
        model.save_pretrained(out / name)
        written.append(out / name)
    return written
