"""Flux ControlNets (Diffusers' ``FluxControlNetModel``, InstantX layout) for the families whose denoiser is a
``FluxTransformer2DModel`` (``flux_controlnet``: FLUX.1-dev as ``FluxControlNetInpaintPipeline`` runs it; ``flux_fill``:
our extension feeding the residuals to the Fill transformer): which ControlNets fit, union modes, and the residuals of
a step's group of requests, as ``FluxMultiControlNetModel`` computes them for one request: each ControlNet's block
samples times its conditioning scale (``controlnet_keep``: 0 outside the control's [start, end] of the schedule),
summed over the request's controls in order.

Batched across requests: every ControlNet runs once per step over the rows of all requests (and all controls of a
request) that use it, with a per-row conditioning scale; then each request's residuals are merged in its control
order. Merging follows ``FluxMultiControlNetModel.forward``: the first control's lists are the base; a later one is
added element-wise (``zip``: the shorter list's length) when both have the kind, else skipped. So a request's
*structure* (double / single list lengths, or None) depends only on its ControlNets, not on the step.

A control whose scale this step is 0 adds exact zeros: it is not computed (``x + 0.0 == x``); a request with no
control acting this step takes no residuals. Rows in one transformer call share the residual lists' lengths (they
decide which transformer block takes which sample): ``calls`` splits a group by structure, rows without residuals
join the first call with zero rows (exact again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# InstantX FLUX.1-dev-Controlnet-Union's control modes (its model card): the index a union control's mode selects.
UNION_MODES = {"canny": 0, "tile": 1, "depth": 2, "blur": 3, "pose": 4, "openpose": 4, "gray": 5, "lq": 6}


def is_union(config: dict) -> bool:
    """Flux union and plain ControlNets are one class; a union one has control modes (``num_mode``)."""
    return config.get("num_mode") is not None


def mode_index(mode: str, config: dict) -> int:
    if mode not in UNION_MODES:
        raise ValueError(f"mode {mode!r} is not a Flux union mode ({', '.join(UNION_MODES)})")
    index = UNION_MODES[mode]
    if index >= config.get("num_mode", 0):
        raise ValueError(f"mode {mode!r} is number {index} and it has {config.get('num_mode')} modes")
    return index


def check_fits(controlnet, denoiser, latent_channels: int) -> None:
    """``ValueError`` (a reason) unless ``controlnet`` takes ``latent_channels`` packed latents and has the
    transformer's text, pooled and inner widths (its residuals are added to the transformer's hidden states)."""
    c, t = controlnet.config, denoiser.config
    if getattr(c, "conditioning_embedding_channels", None) is not None:  # (a config, or its namespace: ``check_remote``)
        raise ValueError("takes its control image in pixels (XLabs layout); Flux ControlNets here take it through "
                         "the VAE (InstantX layout)")
    inner = lambda x: x.num_attention_heads * x.attention_head_dim  # noqa: E731
    ours = [c.in_channels, c.joint_attention_dim, c.pooled_projection_dim, inner(c)]
    want = [latent_channels, t.joint_attention_dim, t.pooled_projection_dim, inner(t)]
    if ours != want:
        raise ValueError(f"does not fit the transformer (latent / text / pooled / inner widths {ours}, want {want})")


@dataclass
class Use:
    """One control of one request acting this step."""

    row: int  # the request's row in the step's batch
    order: int  # its index among the request's controls
    cond: torch.Tensor  # (1, N, C) the control image's packed latents
    scale: float  # conditioning scale times keep, this step
    mode: int | None  # a union ControlNet's control mode


def structure(nets: list) -> tuple[int | None, int | None]:
    """(double, single) lengths of the merged residual lists of a request using ``nets`` in order (None: none)."""
    return structure_of([n.config for n in nets])


def structure_of(configs: list) -> tuple[int | None, int | None]:
    """``structure`` from the ControlNets' configs (``config.json`` dicts or loaded models' configs: placed in the
    ``controlnet`` model, the denoiser loads no weights)."""
    out = []
    for key in ("num_layers", "num_single_layers"):
        lengths = [int(c.get(key, 0) or 0) for c in configs]
        if not lengths or lengths[0] == 0:
            out.append(None)
        else:
            out.append(min(x for x in lengths if x > 0))
    return out[0], out[1]


@torch.no_grad()
def per_net(net, uses: list[Use], latents, timestep, guidance, pooled, text, txt_ids, img_ids):
    """One ControlNet call over the rows of ``uses``: (double samples, single samples), each a list of (U, N, D)
    already scaled per row (or None)."""
    rows = torch.tensor([u.row for u in uses], device=latents.device)
    scale = torch.tensor([u.scale for u in uses], dtype=latents.dtype, device=latents.device).view(-1, 1, 1)
    mode = None
    if net.union:
        mode = torch.tensor([u.mode for u in uses], dtype=torch.long, device=latents.device).view(-1, 1)
    return net(hidden_states=latents[rows], controlnet_cond=torch.cat([u.cond for u in uses]).to(latents.dtype),
               controlnet_mode=mode, conditioning_scale=scale, timestep=timestep[rows],
               guidance=guidance[rows] if net.config.guidance_embeds and guidance is not None else None,
               pooled_projections=pooled[rows], encoder_hidden_states=text[rows], txt_ids=txt_ids, img_ids=img_ids,
               return_dict=False)


def merge(parts: list, shape: tuple[int | None, int | None]):
    """A request's residuals from its controls' samples in control order (``parts``: (double, single) per acting
    control, each a list of (N, D) or None), cut to ``shape``. None when no control acts this step."""
    if not parts:
        return None
    out = []
    for kind, length in enumerate(shape):
        if length is None:
            out.append(None)
            continue
        acc = None
        for p in parts:
            samples = p[kind]
            if samples is None:
                continue
            acc = list(samples[:length]) if acc is None else [a + s for a, s in zip(acc, samples)]
        out.append(acc)
    return tuple(out)


def compute(uses: dict, batch: int, latents, timestep, guidance, pooled, text, txt_ids, img_ids, shapes: list,
            run=None):
    """Each row's merged residuals (or None). ``uses``: ControlNet -> its ``Use``s; ``shapes``: each row's
    structure; ``run(net, uses, call)``: makes each ControlNet call (the activation cache's, for its hooks)."""
    parts: list[list] = [[] for _ in range(batch)]
    for net, net_uses in uses.items():
        call = lambda: per_net(net, net_uses, latents, timestep, guidance, pooled, text, txt_ids, img_ids)  # noqa
        double, single = call() if run is None else run(net, net_uses, call)
        for j, u in enumerate(net_uses):
            parts[u.row].append((u.order, ([d[j] for d in double] if double is not None else None,
                                           [s[j] for s in single] if single is not None else None)))
    return [merge([p for _, p in sorted(parts[i], key=lambda x: x[0])], shapes[i]) for i in range(batch)]


def calls(rows: list, shapes: list) -> list[list[int]]:
    """Rows of one group split into transformer calls: rows with residuals by their (double, single) lengths, rows
    without any joining the first call."""
    keyed: dict = {}
    plain = []
    for i, r in enumerate(rows):
        if r is None:
            plain.append(i)
        else:
            keyed.setdefault(shapes[i], []).append(i)
    out = list(keyed.values()) or [[]]
    out[0] = sorted(out[0] + plain)
    return out


def stacked(rows: list, idx: list[int], like: torch.Tensor):
    """The residual lists for the call of rows ``idx``: (B, N, D) per block, zeros for rows without (None when no
    row of the call has that kind)."""
    out = []
    for kind in (0, 1):
        have = [rows[i][kind] for i in idx if rows[i] is not None and rows[i][kind] is not None]
        if not have:
            out.append(None)
            continue
        n = len(have[0])
        zero = torch.zeros_like(have[0][0])
        out.append([torch.stack([rows[i][kind][b] if rows[i] is not None and rows[i][kind] is not None else zero
                                 for i in idx]) for b in range(n)])
    return out[0], out[1]


def step_residuals(group: list, controls_of, latents, timestep, guidance, pooled, text, txt_ids, img_ids, run=None):
    """The residuals of a step's ``group``: (rows, shapes) for ``calls`` / ``stacked``. ``controls_of(job)``: the
    job's ((ActiveControl, mode index or None, (1, N, C) control latents), ...) in control order."""
    uses: dict = {}  # ControlNet -> its uses this step (keyed by the loaded model: shared by name)
    shapes = []
    for i, j in enumerate(group):
        controls = controls_of(j)
        for k, (active, mode, ctrl) in enumerate(controls):
            s = active.scale_for(j)  # the stock loop counts the steps it runs
            if s != 0:
                uses.setdefault(active.model, []).append(Use(i, k, ctrl, s, mode))
        shapes.append(structure([a.model for a, _, _ in controls]))
    if not uses:
        return [None] * len(group), shapes
    return compute(uses, len(group), latents, timestep, guidance, pooled, text, txt_ids, img_ids, shapes, run), shapes
