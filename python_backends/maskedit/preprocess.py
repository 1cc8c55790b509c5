"""Stage 1: turn an edit request (encoded template + mask + prompt) into the denoiser's tensors.

Decoding, validation, the token mask and the cache key are the same for every family; the tensor math is the
family's (``ModelFamily.prepare``), which mirrors its stock pipeline's ``__call__`` and calls the pipeline's own
methods with one generator consumed in the same order, so the served result equals stock Diffusers for the same
seed (tested).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from maskedit_common.controls import IMAGES, ControlSpecError, check_images

from . import imaging
from .adapters.library import AdapterLibrary
from .cache.key import cache_key, control_identity, dir_digest, image_digest, model_fingerprint
from .components import family, load_pipeline
from .controlnets import preprocessors
from .controlnets.job import ControlInput
from .controlnets.library import ControlNetLibrary
from .errors import InvalidInput
from .params import EditParams
from .schedule import first_step
from .settings import Settings

log = logging.getLogger(__name__)
REFERENCES = "REFERENCE_IMAGES"


@dataclass
class PreparedEdit:
    """Everything downstream stages need; arrays only, so it crosses process boundaries as tensors."""

    params: EditParams
    model_w: int
    model_h: int
    template_rgb: np.ndarray  # (H, W, 3) uint8 at the template's own size
    alpha: np.ndarray  # (H, W) uint8, feathered compositing mask at the template's size
    token_mask: np.ndarray  # (tokens,) bool, packed token order
    template_hash: str
    was_base64: bool
    cache_key: str = ""
    base_cache_key: str = ""  # with adapters: the key the same request has without them (``lora_base_reuse``)
    loras: tuple = ()  # its adapters checked against the library: ``ResolvedRef`` (name, scale, digest)
    controls: tuple = ()  # its ControlNets: ``controlnets.job.ControlInput`` (spec + the family's prepared image)
    first_step: int = 0  # STRENGTH < 1: the schedule step it starts at (``schedule.first_step``)
    crop: tuple | None = None  # PADDING_MASK_CROP: (x1, y1, x2, y2) of the template the model edits, else None
    # Model tensors; empty (0 rows) when the mask is empty and the model is skipped.
    latents: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # (tokens, C) packed
    cond: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # masked-image latents + mask
    prompt_embeds: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # (txt, D)
    pooled_embeds: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.float32))  # (D_pooled,)
    # Reference images beyond the template (in-context edit models): their tokens and token grids (rows, cols).
    reference: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # (R, C)
    reference_grids: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))  # (images, 2)

    @property
    def mask_ratio(self) -> float:
        return float(self.token_mask.mean()) if self.token_mask.size else 0.0

    @property
    def empty_mask(self) -> bool:
        return not self.token_mask.any()

    @property
    def true_cfg_scale(self) -> float:
        """TRUE_CFG_SCALE as the denoiser applies it: with a negative row only (``FluxInpaintPipeline``'s
        ``do_true_cfg``), else 1 (none)."""
        p = self.params
        return p.true_cfg_scale if p.true_cfg_scale > 1 and p.negative_prompt else 1.0

    @property
    def skip_model(self) -> bool:
        """Nothing to edit and nothing to record: the template comes back as is."""
        return self.empty_mask and not self.params.register


class Preprocessor:
    def __init__(self, settings: Settings, store=None):
        """``store``: the activation store to check and prefetch from (``maskedit.cache.store``), or None."""
        self.settings = settings
        self.pipe = load_pipeline(settings, with_transformer=False)
        self.scheduler_config = dict(self.pipe.scheduler.config)
        self.fingerprint = model_fingerprint(settings.model_dir, settings.model_version)
        self.store = store
        self.adapters = AdapterLibrary(settings.adapters)
        self.family = family(settings)
        self.controlnets = ControlNetLibrary(settings.controlnets, self.family, settings)
        geometry = self.family.geometry(settings)
        self.patch, self.multiple = geometry.patch, geometry.multiple  # pixels per token side; size multiple

    def count_t5_tokens(self, prompt: str) -> int:
        """Tokens of ``prompt`` in the encoder whose length is limited (Flux: T5; SD 2 / SDXL: CLIP's 77)."""
        return self.family.count_prompt_tokens(self.pipe, prompt)

    @torch.no_grad()
    def __call__(self, template: bytes, mask: bytes, params: EditParams, control_images=(),
                 reference_images=()) -> PreparedEdit:
        """``control_images``: the encoded control images (``CONTROL_IMAGES``), one per ``params.controls``;
        ``reference_images``: the encoded reference images (``REFERENCE_IMAGES``) of an in-context edit model."""
        s = self.settings
        template_raw, was_b64 = imaging.maybe_base64(template)
        mask_raw, _ = imaging.maybe_base64(mask)
        tpl = imaging.decode_image(template_raw, "TEMPLATE", s.max_input_pixels).convert("RGB")
        msk = imaging.decode_image(mask_raw, "MASK", s.max_input_pixels)
        binary = imaging.binary_mask(msk, tpl.size, s.mask_threshold)
        for field, text in (("PROMPT", params.prompt), ("NEGATIVE_PROMPT", params.negative_prompt)):
            n_tokens = self.count_t5_tokens(text) if text else 0
            if n_tokens > s.max_sequence_length:
                raise InvalidInput(
                    f"is {n_tokens} tokens long, above the model's limit of {s.max_sequence_length}", field)
        if params.negative_prompt and not self.family.uses_negative_prompt(params):
            hint = " unless TRUE_CFG_SCALE is above 1" if "true_cfg_scale" in self.family.served_options() else ""
            raise InvalidInput(f"is not used by {self.family.pipeline_class_name} models (their guidance is "
                               f"embedded: there is no negative row{hint}); leave it out", "NEGATIVE_PROMPT")

        loras = self.adapters.resolve(params.loras) if params.loras else ()
        controls = self._decode_controls(params.controls, control_images)
        references = self._decode_references(reference_images)
        first = first_step(self.family.pipeline_class(), params.steps, params.strength)
        self.family.check_options(params)
        w, h = self.family.model_size(*tpl.size, s)
        template_rgb = np.asarray(tpl, dtype=np.uint8)
        mask_img = imaging.Image.fromarray(binary)
        # PADDING_MASK_CROP: the stock pipelines' crop around the mask, widened to the model's aspect, resized to the
        # model's size ("fill"); the result is pasted back at the crop by decoding (``Decoder.finish``)
        crop = self.pipe.mask_processor.get_crop_region(mask_img, w, h, pad=params.padding_mask_crop) \
            if params.padding_mask_crop is not None and binary.any() else None
        fit = {"crops_coords": crop, "resize_mode": "fill"} if crop is not None else {}
        mask_t = self.pipe.mask_processor.preprocess(mask_img, height=h, width=w, **fit)  # (1,1,h,w) in {0,1}
        tokens = imaging.token_mask(mask_t[0, 0].numpy(), self.patch)
        prepared = PreparedEdit(
            params=params, model_w=w, model_h=h, template_rgb=template_rgb,
            alpha=imaging.soft_mask(binary, s.feather_px), token_mask=tokens,
            template_hash=hashlib.sha256(template_rgb.tobytes()).hexdigest()[:32], was_base64=was_b64, loras=loras,
            first_step=first, crop=None if crop is None else tuple(int(v) for v in crop),
        )
        if params.use_cache:
            # STRENGTH: where the family blends the template back every step, not in the key (an entry serves every
            # edit starting at its first step or later, ``cache.decision.fits``); elsewhere the first step is.
            # The crop is: its pixels are the model's template. The reference images are: their rows are the entry's.
            start = 0 if self.family.blends_unmasked else first
            ref_digests = [image_digest(img) for img in references]
            key = lambda **kw: cache_key(self.fingerprint, prepared.template_hash, w, h, params.steps,  # noqa: E731
                                         params.guidance, params.template_seed, self.scheduler_config, s.dtype,
                                         references=ref_digests, crop=prepared.crop, first_step=start, **kw)
            prepared.cache_key = key(adapters=[(r.name, r.scale, r.digest) for r in loras],
                                     controls=self._control_identities(controls))
            if loras:
                prepared.base_cache_key = key()
        if prepared.skip_model:
            return prepared  # nothing to edit: the template comes back without running the model
        if self.store is not None and prepared.cache_key:
            self.store.prefetch(prepared.cache_key)  # promote from disk while the request queues
            if prepared.base_cache_key and s.cache.lora_base_reuse:
                self.store.prefetch(prepared.base_cache_key)

        init_image = self.pipe.image_processor.preprocess(tpl, height=h, width=w, **fit).to(dtype=torch.float32)
        t = self.family.prepare(self.pipe, self.scheduler_config, init_image, mask_t, tokens, w, h, params, s)
        # With a crop each family treats its control images as its stock ControlNet pipeline does (the SD / SDXL
        # ones crop them with the template's box, FluxControlNetInpaintPipeline does not): the box in template pixels
        prepared.controls = tuple(
            ControlInput(spec, _np(self.family.prepare_control_image(self.pipe, img, w, h, s, crop=prepared.crop)))
            for spec, img in controls)
        prepared.latents, prepared.cond = _np(t.latents), _np(t.cond)
        prepared.prompt_embeds, prepared.pooled_embeds = _np(t.prompt_embeds), _np(t.pooled_embeds)
        if references:
            box = None if crop is None else _scaled(crop, w / tpl.size[0], h / tpl.size[1])
            rows, grids = self.family.prepare_references(self.pipe, references, w, h, s, crop=box)
            prepared.reference, prepared.reference_grids = _np(rows), np.asarray(grids, np.int32).reshape(-1, 2)
        return prepared

    def _decode_references(self, images) -> list:
        """The reference images (PIL RGB), checked: as many as the family and the deployment take, each decodable
        and of a size the template could have; errors name REFERENCE_IMAGES and the image's index."""
        images = list(images or ())
        if not images:
            return []
        limit = min(self.family.max_reference_images, self.settings.max_reference_images)
        if not self.family.max_reference_images:
            raise InvalidInput(f"is not used by {self.family.pipeline_class_name} models (they take no reference "
                               "image); leave it out", REFERENCES)
        if len(images) > limit:
            raise InvalidInput(f"has {len(images)} images, above the limit of {limit} for this model", REFERENCES)
        out = []
        for i, data in enumerate(images):
            raw, _ = imaging.maybe_base64(data if isinstance(data, bytes) else str(data).encode())
            try:
                out.append(imaging.decode_image(raw, REFERENCES, self.settings.max_input_pixels).convert("RGB"))
            except InvalidInput as e:
                raise InvalidInput(f"reference {i}: {str(e).removeprefix(REFERENCES + ': ')}", REFERENCES) from None
        return out

    def _control_identities(self, controls) -> list:
        """Each control's part of the cache key (``cache.key.control_identity``)."""
        return [control_identity(spec, dir_digest(self.controlnets.path(spec.name, i)), image_digest(img))
                for i, (spec, img) in enumerate(controls)]

    def _decode_controls(self, specs, images) -> list:
        """(spec, PIL image with its preprocessor applied) per control; bad input names CONTROLS / CONTROL_IMAGES
        and the control's index."""
        images = list(images or ())
        try:
            check_images(specs, len(images))
        except ControlSpecError as e:
            raise InvalidInput(str(e), e.field) from None
        if not specs:
            return []
        self.controlnets.check(specs)
        out = []
        for i, (spec, data) in enumerate(zip(specs, images)):
            raw, _ = imaging.maybe_base64(data if isinstance(data, bytes) else str(data).encode())
            try:
                img = imaging.decode_image(raw, IMAGES, self.settings.max_input_pixels).convert("RGB")
            except InvalidInput as e:
                raise InvalidInput(f"control {i}: {str(e).removeprefix(IMAGES + ': ')}", IMAGES) from None
            out.append((spec, preprocessors.apply(spec.preprocess, img)))
        return out


def _scaled(box, sx: float, sy: float) -> tuple[int, int, int, int]:
    """A box (x1, y1, x2, y2) of the template in a frame ``sx`` x ``sy`` times its size."""
    x1, y1, x2, y2 = box
    return round(x1 * sx), round(y1 * sy), round(x2 * sx), round(y2 * sy)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()
