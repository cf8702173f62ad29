"""FP64 references of the two boundaries: exact math between the kernels' BF16 rounding points.

The fused kernels round where these round (``mhc_core.reference`` documents the kernels' rounding
points): the all-reduced sublayer output, each post-mixed stream and the collapse to BF16; the
layer input to BF16 after the norm; GLM's raw mixes, post-mix and residual mix stay FP32.
Everything between two rounding points is computed here in FP64, so a kernel's distance from these
values is its own arithmetic only, bounded term by term in ``demo.tolerance``.

At tp > 1 the reduced input needs every rank's partial: ``reduced`` gathers them (eager NCCL,
outside any graph; every rank calls it together).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mhc_core import MoEOutput
from mhc_glm5.reference import softmax_sinkhorn

from .config import HC, MixesConfig
from .tolerance import U, bf16_ulp

F64 = torch.float64
BF16 = torch.bfloat16


class Reduced(NamedTuple):
    """The reduced sublayer output ``value`` (BF16, what the kernel post-mixes) and ``error``, the most
    the kernel's own reduced value may differ from it elementwise (0 where it reads x itself)."""

    value: Tensor
    error: Tensor


def finalize(moe: MoEOutput) -> Tensor:
    """FP64 ``shared + sum_k weight_k * gemm2[index_k]`` (an index of -1 is a route this rank does not hold)."""
    index = moe.expanded_idx_to_permuted_idx.long()
    rows = moe.gemm2_permuted.to(F64)[index.clamp(min=0)]
    taken = (index >= 0).unsqueeze(-1)
    weighted = torch.where(taken, moe.expert_weights.to(F64).unsqueeze(-1) * rows, torch.zeros_like(rows))
    return moe.shared_output.to(F64) + weighted.sum(1)


def finalize_magnitude(moe: MoEOutput) -> Tensor:
    """``|shared| + sum_k |weight_k| |gemm2[index_k]|`` (FP64): the terms' size in a finalize's error."""
    magnitude = MoEOutput(
        moe.gemm2_permuted.abs(), moe.expert_weights.abs(), moe.expanded_idx_to_permuted_idx, moe.shared_output.abs()
    )
    return finalize(magnitude)


def _gather(tensor: Tensor, group) -> list[Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def reduced(x, group=None) -> Reduced:
    """What the fused op post-mixes: the TP sum of every rank's partial ``x`` (a tensor or a ``MoEOutput``).

    The kernel's value (derivation of ``error``): a MoE rank's publish rounds its FP32 finalize
    (``top_k + 1`` terms, in some order, with or without FMA) to BF16, within ``ulp + 2 (top_k + 1)
    u S`` of the exact value rounded, ``S`` the terms' magnitude; the collective then sums the
    ``tp`` BF16 partials in FP32 (``tp - 1`` roundings, within ``2 tp u sum |partial|``) and rounds
    once more (one more ulp). At tp 1 with a plain tensor the kernel reads x itself: error 0.
    """
    tp = 1 if group is None else _world(group)
    if isinstance(x, MoEOutput):
        top_k = x.expert_weights.shape[1]
        partial = finalize(x).to(BF16)
        own_error = bf16_ulp(partial) + 2 * (top_k + 1) * U * finalize_magnitude(x).float()
    else:
        if tp == 1:
            return Reduced(x, torch.zeros((), dtype=torch.float32, device=x.device))
        partial, own_error = x, torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    partials, errors = ([partial], [own_error]) if tp == 1 else (_gather(partial, group), _gather(own_error, group))
    total = torch.stack([p.to(F64) for p in partials]).sum(0)
    magnitude = torch.stack([p.to(F64).abs() for p in partials]).sum(0).float()
    value = total.to(BF16)
    error = bf16_ulp(value) + torch.stack(errors).sum(0) + 2 * tp * U * magnitude
    return Reduced(value, error)


def _world(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


# --------------------------------------------------------------------- both models
def post_mix(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """``bf16(x post_j + sum_i residual_i comb_ij)`` per stream ``j``, the sum in FP64."""
    m, hc = residual.shape[:2]
    mixed = x.to(F64).unsqueeze(1) * post.reshape(m, hc, 1).to(F64) + torch.einsum(
        "mih,mij->mjh", residual.to(F64), comb.to(F64)
    )
    return mixed.to(BF16)


def rms_norm(prenorm: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``bf16(c rsqrt(mean(c^2) + eps) w)`` of a BF16 ``c``, in FP64."""
    c = prenorm.to(F64)
    inv_rms = torch.rsqrt((c * c).mean(-1, keepdim=True) + eps)
    return (c * inv_rms * weight.to(F64)).to(BF16)


# --------------------------------------------------------------------------- DSV4.1
def dsv41_collapse(streams: Tensor, pre: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(collapse, layer_input)``: ``c = bf16(sum_j s_j pre_j)`` of BF16 streams, then the norm."""
    collapse = (streams.to(F64) * pre.to(F64).unsqueeze(-1)).sum(1).to(BF16)
    return collapse, rms_norm(collapse, weight, eps)


# ---------------------------------------------------------------------------- GLM-5.3
def glm5_mixes(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, weight: Tensor, config: MixesConfig, norm_eps: float
) -> dict[str, Tensor]:
    """Everything GLM's boundary computes from its BF16 streams, in FP64 between the rounding points:
    ``raw``, ``rstd``, ``magnitude`` (``|s| @ |fn|^T``, for the bounds), ``pre``, ``collapse``,
    ``layer_input`` (BF16) and ``post_out`` ``[M, 4, 1]``, ``comb_out`` ``[M, 4, 4]`` (FP32)."""
    flat = streams.to(F64).flatten(1)
    fn64 = fn.to(F64)
    rstd = torch.rsqrt((flat * flat).mean(-1, keepdim=True) + config.rms_eps)
    raw = (flat @ fn64.t()) * rstd
    scale, base = scale.to(F64), base.to(F64)
    pre = torch.sigmoid(raw[:, :HC] * scale[0] + base[:HC]) + config.hc_eps
    collapse = (streams.to(F64) * pre.unsqueeze(-1)).sum(1).to(BF16)
    post_out = torch.sigmoid(raw[:, HC : 2 * HC] * scale[1] + base[HC : 2 * HC]) * config.post_mult
    logits = (raw[:, 2 * HC :] * scale[2] + base[2 * HC :]).reshape(-1, HC, HC)
    return {
        "raw": raw,
        "rstd": rstd,
        "magnitude": flat.abs() @ fn64.abs().t(),
        "pre": pre,
        "collapse": collapse,
        "layer_input": rms_norm(collapse, weight, norm_eps),
        "post_out": post_out.unsqueeze(-1).float(),
        "comb_out": softmax_sinkhorn(logits, config.hc_eps, config.sinkhorn_repeat).float(),
    }
