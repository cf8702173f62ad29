"""DSV4.1's torch reference: ``AllReduceMHC``'s boundary, rounded where the kernel rounds
(``mhc_core.reference`` holds the model-independent pieces and the rounding rules)."""

from __future__ import annotations

import torch

from mhc_core.reference import post_mix, rms_norm


def dsv41_boundary(
    reduced: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSV4.1 ``AllReduceMHC`` after the all-reduce: ``(residual_out, layer_input)``.

    ``reduced`` is the BF16 all-reduced sublayer output. The collapse is
    ``bf16(sum_j bf16(mixed_j) * pre[j])``, streams added in order from zero.
    """
    residual_out = post_mix(reduced, residual, post, comb)
    streams = residual_out.float()
    pre = pre.float()
    collapse = torch.zeros_like(streams[:, 0])
    for target in range(streams.shape[1]):
        collapse = collapse + streams[:, target] * pre[:, target : target + 1]
    return residual_out, rms_norm(collapse.to(torch.bfloat16), norm_weight, norm_eps)
