"""What an engine runs today instead of the fused op: a plain, idiomatic PyTorch boundary (not the
rounding-mirroring reference), eager or under ``torch.compile(mode="max-autotune-no-cudagraphs")``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def boundary(x, residual, post, comb, pre, norm_weight, norm_eps: float):
    """mHC post-mix, carried-pre collapse and RMSNorm after the (already reduced) sublayer output."""
    mixed = x.float().unsqueeze(1) * post.unsqueeze(-1) + torch.einsum("mih,mij->mjh", residual.float(), comb)
    residual_out = mixed.to(torch.bfloat16)
    collapse = torch.einsum("mjh,mj->mh", residual_out.float(), pre).to(torch.bfloat16)
    return residual_out, F.rms_norm(collapse, (collapse.shape[-1],), norm_weight, norm_eps)


@functools.cache
def compiled() -> Callable[..., object]:
    return torch.compile(boundary, mode="max-autotune-no-cudagraphs", dynamic=False)
