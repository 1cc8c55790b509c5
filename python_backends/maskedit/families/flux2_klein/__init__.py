"""FLUX.2 [klein] inpainting (``diffusers.Flux2KleinInpaintPipeline``) as the model family ``flux2_klein``.

Files: ``tiny.py`` (presets ``tiny`` 256 px / ``bench`` 512 px with klein 4B's 5 double + 20 single blocks at
256 wide / ``klein-4b`` the real transformer, weights generated on the device), ``prepare.py`` (request tensors,
the step, decoding), ``family.py`` (``Flux2KleinFamily``, the ``ModelFamily`` protocol), ``cache.py`` (the
mask-aware block hooks).

How the pipeline inpaints (and how it differs from Flux Fill)
--------------------------------------------------------------
Flux Fill feeds the mask and the masked image to the transformer as extra *channels* of every token. Klein does
not see the mask at all: the template's clean VAE latents (batch-norm normalised, 2x2 patchified, packed) are
appended as N *reference* tokens after the N noisy tokens (position ids ``(T, H, W, L)`` with ``T = 0`` for noisy,
``T = 10`` for reference tokens), and after every scheduler step the pipeline blends the latents back to the
template outside the mask: ``latents = (1 - m) * scale_noise(image_latents, t_next, noise) + m * latents``
(``m``: the mask bilinearly resized to the token grid; after the last step the unnoised image latents). Text is
Qwen3's hidden states 9, 18, 27 of the chat-templated prompt, stacked (``3 * hidden`` wide), padded to
``max_sequence_length``; there is no pooled text and no guidance embedding (klein 4B is step-distilled; base
models with guidance > 1 would need a negative row and are refused). The VAE is encoded with its mode, so the
generator only draws the noise.

Tensor slots (``Prepared`` / ``DenoiseInputs``; N tokens = (h/16) * (w/16), C = 4 * VAE latent channels)
---------------------------------------------------------------------------------------------------------
- ``latents`` (N, C): the initial noisy latents, one row per noisy image token in packed (row-major) order. At
  strength 1.0 these equal the noise. This is the only per-token tensor the engine and the cache index.
- ``cond`` (N, 2C + 1): ``[reference latents (C) | noise (C) | blend mask m (1)]`` per token. The reference latents
  are both the transformer's appended tokens and the blend target ``image_latents``; the noise is what the blend
  re-noises them with; ``m`` in [0, 1] is > 0 only on tokens of ``token_mask``.
- ``prompt_embeds`` (L, 3 * Qwen3 hidden) with L = ``max_sequence_length``.
- ``pooled_embeds`` (1,): zeros (unused).
- ``reference`` (k N, C), optional (``REFERENCE_IMAGES``, the pipeline's ``image_reference`` list): further reference
  images' packed latents, pre-processed together at the model size (``resize_mode="crop"``), after the template's
  tokens with time coordinates 20, 30, ... (``prepare.reference_latents``, ``prepare.latent_ids``).
Seeds: one generator seeded with TEMPLATE_SEED draws the noise as the pipeline does; tokens of ``token_mask``
then take noise drawn from SEED (in ``latents`` and in ``cond``'s noise), so unmasked tokens and the reference
tokens depend only on the template, TEMPLATE_SEED and the settings in the cache key, as for Flux Fill.

The step: one transformer call per group (same resolution and text length) on ``[latents; reference]`` with the
ids above, the noise prediction of the first N tokens, each job's own scheduler step, then the blend. The
timestep embedding and modulation layers run per batch row (``families.per_row``) so a batched call equals the
stock one-request call bit for bit on the CPU.

The mask-aware path
-------------------
Klein fits it. Every block is token-wise (norms, shared per-request modulation, projections, SwiGLU MLPs) except
one bidirectional softmax attention over ``[text; noisy; reference]`` with rotary positions per token: exactly
what the gathered computation of ``maskedit.families.flux_fill.cache`` reproduces (queries for the computed tokens,
keys/values of cached tokens from recorded rows or their recorded inputs, rotary tables gathered by sequence
position). And the blend makes unmasked noisy tokens follow the template's trajectory *exactly* (their inputs at
every step are the template run's), which Flux Fill only approximates. Mapping:
- the cache's tokens are the N noisy tokens then the reference tokens (``Flux2KleinCacheHooks.reference_tokens``:
  the runtime's *reference rows*, docs/caching.md): entries of N + R rows per block, ``idx_c`` / ``idx_u`` over
  both, keys/values recorded with rotary at sequence position ``L + i``. References are never edited: a hit
  computes the text and its masked noisy tokens (L + |masked| of L + N + R). A reference token's rows depend on the
  noisy tokens through attention, as an unmasked token's do: reusing them under another mask or prompt is the same
  approximation (measured in ``klein-bench``'s results);
- ``noctx`` attends to the text and the computed noisy tokens only;
- cached rows the last block does not write would still reach the output projection; the blend multiplies
  their prediction by ``m = 0`` (reference rows' predictions are dropped), so the runtime's ``needs_output`` (last
  block always written) keeps them finite.
The packed (mixed-resolution) path is not implemented (the family groups by resolution and references).
"""

from .family import Flux2KleinFamily, KleinTensors

__all__ = ["Flux2KleinFamily", "KleinTensors"]
