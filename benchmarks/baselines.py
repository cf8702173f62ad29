"""What an engine runs today: plain, idiomatic PyTorch boundaries (not the rounding-mirroring
references), eager or under ``torch.compile(mode="max-autotune-no-cudagraphs")``."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mhc_glm5.reference import softmax_sinkhorn


def dsv41_boundary(x, residual, post, comb, pre, norm_weight, norm_eps: float):
    """mHC post-mix, carried-pre collapse and RMSNorm after the (already reduced) sublayer output."""
    mixed = x.float().unsqueeze(1) * post.unsqueeze(-1) + torch.einsum("mih,mij->mjh", residual.float(), comb)
    residual_out = mixed.to(torch.bfloat16)
    collapse = torch.einsum("mjh,mj->mh", residual_out.float(), pre).to(torch.bfloat16)
    return residual_out, F.rms_norm(collapse, (collapse.shape[-1],), norm_weight, norm_eps)


def glm5_boundary(
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


@functools.cache
def compiled(name: str):
    function = {"dsv41": dsv41_boundary, "glm5": glm5_boundary}[name]
    return torch.compile(function, mode="max-autotune-no-cudagraphs", dynamic=False)
