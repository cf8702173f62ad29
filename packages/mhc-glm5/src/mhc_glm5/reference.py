"""GLM-5.3's torch reference: ``AllReduceMhcBoundary``'s boundary and side mixes, rounded where the
kernels round (``mhc_core.reference`` holds the model-independent pieces and the rounding rules)."""

from __future__ import annotations

import torch

from mhc_core.reference import post_mix, rms_norm, sinkhorn

MIX = 24  # GLM raw mixes per token: 4 pre, 4 post, 16 residual mix
HC_GLM = 4


def sigmoid(values: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(values.float())


def glm5_mixes(streams: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """Raw mixes ``[M, 24]``: ``(fn @ s) * rsqrt(sum(s^2) / (4 hidden) + rms_eps)`` over BF16 streams ``s``."""
    flat = streams.float().reshape(streams.shape[0], -1)
    rstd = torch.rsqrt((flat * flat).sum(-1, keepdim=True) / flat.shape[1] + rms_eps)
    return (flat @ fn.float().t()) * rstd


def glm5_side_mixes(
    raw: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, hc_eps: float, post_mult: float, sinkhorn_repeat: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The side stream's ``(post_out [M, 4, 1], comb_out [M, 4, 4])`` from raw mixes."""
    post_out = sigmoid(raw[:, 4:8] * scale[1] + base[4:8]) * post_mult
    logits = (raw[:, 8:24] * scale[2] + base[8:24]).reshape(-1, HC_GLM, HC_GLM)
    return post_out.unsqueeze(-1), sinkhorn(logits, hc_eps, sinkhorn_repeat)


def glm5_boundary(
    reduced: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    post_mult: float,
    sinkhorn_repeat: int,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GLM-5.3 ``AllReduceMhcBoundary`` after the all-reduce.

    Returns ``(residual_out, post_out, comb_out, layer_input, raw_mixes)``. The
    collapse adds the four weighted streams as the kernel's lane butterfly does:
    ``(t0 + t1) + (t2 + t3)``.
    """
    residual_out = post_mix(reduced, residual, post, comb)
    raw = glm5_mixes(residual_out, fn, rms_eps)
    pre = sigmoid(raw[:, 0:4] * scale[0] + base[0:4]) + hc_eps
    streams = residual_out.float()
    t = [streams[:, j] * pre[:, j : j + 1] for j in range(HC_GLM)]
    collapse = ((t[0] + t[1]) + (t[2] + t[3])).to(torch.bfloat16)
    layer_input = rms_norm(collapse, norm_weight, norm_eps)
    post_out, comb_out = glm5_side_mixes(
        raw, scale, base, hc_eps=hc_eps, post_mult=post_mult, sinkhorn_repeat=sinkhorn_repeat
    )
    return residual_out, post_out, comb_out, layer_input, raw


def softmax_sinkhorn(logits: torch.Tensor, eps: float, repeat: int) -> torch.Tensor:
    """The plain-torch Sinkhorn (an engine's, the demo's FP64 one), in ``logits``' dtype: softmax + eps,
    then ``repeat`` rounds, from the second on dividing each row by its sum + eps, then each column.
    Equal in exact math to ``mhc_core.reference.sinkhorn``; summed in torch's order, not in pairs."""
    c = torch.softmax(logits, dim=-1) + eps
    for iteration in range(repeat):
        if iteration:
            c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c
