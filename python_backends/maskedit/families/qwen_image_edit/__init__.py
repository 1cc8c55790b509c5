"""Qwen-Image-Edit inpainting (``diffusers.QwenImageEditInpaintPipeline``) as the model family ``qwen_image_edit``.

Files: ``tiny.py`` (presets ``qwen-edit-tiny`` 1024 px with a 32x VAE / ``qwen-edit-bench`` Qwen-Image's 60
blocks at 256 wide, 512 px / ``qwen-image-edit`` the real transformer, weights generated on the device),
``processor.py`` (the VL processor where torchvision is missing), ``prompt_cache.py`` (encoded prompts per prompt
and template), ``prepare.py`` (request tensors, decoding), ``step.py`` (the transformer call(s), guidance, the
blend), ``family.py`` (``QwenImageEditFamily``, the ``ModelFamily`` protocol), ``cache.py`` (the mask-aware block
hooks).

How the pipeline inpaints
-------------------------
An MMDiT of 60 dual-stream blocks (``QwenImageTransformer2DModel``) over ``[text; noisy N; reference N]``: the
template's packed VAE latents ride along as N reference tokens (rotary frame 1; the noisy tokens are frame 0), the
mask is not a model input, and after every scheduler step the latents are blended back to the template's trajectory
outside the mask (``prepare``'s docstring has the lines). The text is Qwen2.5-VL's last hidden state over a chat
template holding the prompt *and the template's image tokens*: the encoding depends on the template, its length on
the prompt and the image (no padding). Classifier-free guidance (``true_cfg_scale`` = GUIDANCE, on with a
NEGATIVE_PROMPT) runs a second call on the negative prompt and rescales the combination to the conditional norm.
The model size is the pipeline's own: ``calculate_dimensions`` of about 1024**2 pixels at the template's aspect
(``ModelFamily.model_size``: the protocol method this family added).

Tensor slots (``Prepared`` / ``DenoiseInputs``; N tokens = (h/16) * (w/16), C = 4 * VAE latent channels)
---------------------------------------------------------------------------------------------------------
- ``latents`` (N, C): the initial noisy latents, one row per noisy token in packed (row-major) order (at strength
  1.0, the noise). The only per-token tensor the engine and the cache index.
- ``cond`` (N, 3C): ``[reference latents | noise | blend mask]`` per token: the reference latents are both the
  transformer's appended tokens and the blend target; the noise re-noises them; the blend mask (per channel, in
  {0, 1}) is > 0 only on tokens of ``token_mask``.
- ``prompt_embeds`` (L + L', D): the prompt's L rows, then the negative prompt's L' rows under guidance.
- ``pooled_embeds`` (2,): L and L' (0 without guidance).
Seeds: one generator seeded with TEMPLATE_SEED is drawn as the pipeline draws (the VAE's latent sample, then the
noise); tokens of ``token_mask`` then take the noise a generator seeded with SEED gives at that draw, so unmasked
and reference tokens depend only on the template, TEMPLATE_SEED and the settings in the cache key.

The step: one transformer call per group (same resolution, text length and negative text length) on
``[latents; reference]``, a second on the negative prompts under guidance, each job's scheduler step, the blend. The
timestep embedding and modulation layers run per batch row (``families.per_row``) so a batched call equals the
stock one-request call bit for bit on the CPU.

The mask-aware path
-------------------
As FLUX.2 [klein]'s: the runtime's tokens are the N noisy tokens then the N reference tokens (``reference_tokens``:
the reference rows of docs/caching.md, entries of 2N rows per block, keys / values with their rotary), and the blend
makes unmasked noisy tokens follow the template's trajectory exactly, so their cached rows are exact inputs. A hit
computes the text and its masked noisy tokens only: at mask ratio 0.2, L + 0.2 N of L + 2N tokens. Requests with classifier-free guidance run with the cache off
(``runs_cached``): the negative call's unmasked rows differ from the positive call's and entries hold one row per
token. Adapters are added in the masked path (``adapters_in_masked_path``: every projection is its own Linear, so
the row owners are all the adapters need).
"""

from .family import QwenImageEditFamily

__all__ = ["QwenImageEditFamily"]
