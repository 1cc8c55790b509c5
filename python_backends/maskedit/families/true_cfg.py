"""True classifier-free guidance as FLUX.1's inpainting pipelines run it (``FluxInpaintPipeline``: Flux ControlNet
inpainting without controls; ``FluxKontextInpaintPipeline``): with ``true_cfg_scale`` > 1 and a negative prompt, a
second transformer call over the same image tokens with the negative text, then ``neg + scale * (pos - neg)``.

The negative rows travel behind the prompt's in PROMPT_EMBEDS / POOLED_EMBEDS (``with_negative``), are split off
when a job is admitted (``split_negative``) and run in their own call, every token, outside the activation cache (its
entries hold the prompt's rows; such a request runs in full, ``MaskedDenoiser.decide``). A family that passes its
step context and block hooks to ``apply`` lets that call reuse on the requests' negative stream (temporal reuse:
the context's ``TemporalCall.negative``); without them it runs every block.
"""

from __future__ import annotations

import torch


def with_negative(pipe, params, text: torch.Tensor, pooled: torch.Tensor, settings) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """The prompt's (text (L, D), pooled (D,)) followed by the negative prompt's where the stock pipeline's
    ``do_true_cfg`` holds (``true_cfg_scale`` > 1 and a negative prompt), encoded as it encodes them."""
    if not (getattr(params, "true_cfg_scale", 1.0) > 1 and params.negative_prompt):
        return text, pooled
    neg, neg_pooled, _ = pipe.encode_prompt(prompt=params.negative_prompt, prompt_2=None,
                                            device=settings.torch_device, num_images_per_prompt=1,
                                            max_sequence_length=settings.max_sequence_length)
    return torch.cat([text, neg[0]]), torch.cat([pooled, neg_pooled[0]])


def split_negative(x, text: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """A job's (text (1, L, D), pooled (1, D), negative (text, pooled) or None) from its PROMPT_EMBEDS and
    POOLED_EMBEDS, which hold the negative rows behind the prompt's when ``x.true_cfg_scale`` > 1."""
    if getattr(x, "true_cfg_scale", 1.0) <= 1:
        return text, pooled, None
    if text.shape[1] % 2 or pooled.shape[1] % 2:
        from ..errors import InvalidInput

        raise InvalidInput("has no negative row for TRUE_CFG_SCALE", "PROMPT_EMBEDS")
    (text, neg_text), (pooled, neg_pooled) = text.chunk(2, dim=1), pooled.chunk(2, dim=1)
    return text, pooled, (neg_text, neg_pooled)


def apply(tr, group: list, pred: torch.Tensor, hidden: torch.Tensor, timestep: torch.Tensor, guidance, txt_ids,
          img_ids, ctx=None, hooks_of=None) -> None:
    """Combine ``pred`` (the prompt's noise predictions, (B, N, C)) in place with one more call of ``tr`` for the
    rows of ``group`` whose ``tensors.negative`` is set. ``hidden``: the call's image stream (B, N (+ R), C),
    ``timestep`` as the transformer takes it (already / 1000). ``ctx`` / ``hooks_of``: the prompt's call's step
    context and the family's block hooks (``hooks_of(tr).run``), for temporal reuse on the negative stream."""
    rows = [i for i, j in enumerate(group) if j.tensors.negative is not None]
    if not rows:
        return
    sel = torch.tensor(rows, device=hidden.device)
    forward = lambda: tr(  # noqa: E731
        hidden_states=hidden[sel], timestep=timestep[sel], guidance=guidance[sel] if guidance is not None else None,
        pooled_projections=torch.cat([group[i].tensors.negative[1] for i in rows]),
        encoder_hidden_states=torch.cat([group[i].tensors.negative[0] for i in rows]),
        txt_ids=txt_ids, img_ids=img_ids, joint_attention_kwargs=None, return_dict=False)[0]
    neg = run_negative(tr, forward, ctx, hooks_of, rows)
    n = pred.shape[1]
    for k, i in enumerate(rows):
        pred[i] = neg[k, :n] + group[i].inputs.true_cfg_scale * (pred[i] - neg[k, :n])


def run_negative(tr, forward, ctx=None, hooks_of=None, rows: list[int] | None = None):
    """``forward()``, a negative prompts' call over batch rows ``rows`` of the prompt's call (None: all): through
    the family's block hooks (``hooks_of(tr).run``) with those rows' negative-stream context where temporal reuse
    gives one (``ctx.temporal``'s ``TemporalCall.negative``), else plainly (every block)."""
    tp = ctx.temporal if ctx is not None and hooks_of is not None else None  # ``maskedit.temporal.TemporalCall``
    uctx = tp.negative(rows) if tp is not None else None
    return hooks_of(tr).run(uctx, forward) if uctx is not None else forward()
