"""What an engine runs today instead of the fused op: a plain, idiomatic PyTorch boundary (not the
rounding-mirroring reference), eager or under ``torch.compile(mode="max-autotune-no-cudagraphs")``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mhc_glm5.reference import softmax_sinkhorn

#: The boundary's constants (the GLM-5.3 presets').
CONSTANTS = dict(rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20, norm_eps=1e-5)


def boundary_with(
    x, residual, post, comb, fn, scale, base, norm_weight, *, rms_eps, hc_eps, post_mult, sinkhorn_repeat, norm_eps
):
    """Post-mix, the 24-way prenorm GEMV (a matmul), pre-mix, collapse, RMSNorm, post-mix and a Sinkhorn loop."""
    streams = (x.float().unsqueeze(1) * post + torch.einsum("mih,mij->mjh", residual.float(), comb)).to(torch.bfloat16)
    flat = streams.flatten(1)
    raw = torch.matmul(flat, fn.t()).float() * torch.rsqrt(flat.float().pow(2).mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(raw[:, :4] * scale[0] + base[:4]) + hc_eps
    collapse = (streams.float() * pre.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    layer_input = F.rms_norm(collapse, (collapse.shape[-1],), norm_weight, norm_eps)
    post_out = (torch.sigmoid(raw[:, 4:8] * scale[1] + base[4:8]) * post_mult).unsqueeze(-1)
    mix = softmax_sinkhorn((raw[:, 8:] * scale[2] + base[8:]).view(-1, 4, 4), hc_eps, sinkhorn_repeat)
    return streams, post_out, mix, layer_input


def boundary(*args):
    """``boundary_with`` the presets' constants."""
    return boundary_with(*args, **CONSTANTS)


@functools.cache
def _compiled_with() -> Callable[..., object]:
    return torch.compile(boundary_with, mode="max-autotune-no-cudagraphs", dynamic=False)


def compiled() -> Callable[..., object]:
    return functools.partial(_compiled_with(), **CONSTANTS)
