"""Tolerances between the kernels and ``mhc_core.reference``, derived term by term.

Notation: ``u = 2^-24`` (FP32 unit roundoff), ``ulp(v)`` one BF16 ulp at ``|v|``.
The kernels and the reference take the same BF16 rounding points; they differ in

* FMA contraction: a sum of ``n`` products accumulated with FMAs rounds ``n``
  times instead of ``2n``; either way the FP32 result is within ``n u S`` of the
  exact one, ``S`` the sum of the terms' magnitudes, so the two are within
  ``2 n u S``;
* reduction order (the GEMV and the sums of squares over lanes, warps and CTAs):
  a depth-``d`` tree is within ``d u S`` of the exact sum, so two trees are within
  ``2 d u S``;
* approximate ``rsqrt`` / ``ex2`` / ``rcp`` on the device (relative error below
  ``2^-21`` each) against torch's correctly rounded ones.

When two FP32 values within ``delta`` are rounded to BF16 the results are within
``delta + ulp``: at most one rounding boundary lies between them. Where no terms
cancel ``2 n u S`` is far below an ulp, so this is 1 BF16 ulp; where they cancel
the bound scales with the terms' magnitude ``S``, not with the result.
"""

from __future__ import annotations

import torch

from tests.support import bf16_ulp

U = 2.0**-24
APPROX = 2.0**-21  # relative error of rsqrt.approx / ex2.approx / rcp.approx


def post_mix_tolerance(
    reduced: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, expected: torch.Tensor
) -> torch.Tensor:
    """``residual_out[:, j] = bf16(x post_j + sum_i residual_i comb_ij)``: hc + 1 products."""
    hc = residual.shape[1]
    x = reduced.float().abs()[:, None]
    post = post.reshape(post.shape[0], hc).float().abs()[..., None]
    magnitude = x * post + torch.einsum("mih,mij->mjh", residual.float().abs(), comb.float().abs())
    return bf16_ulp(expected) + 2 * (hc + 1) * U * magnitude


def rms_norm_tolerance(
    prenorm: torch.Tensor, prenorm_error: torch.Tensor, weight: torch.Tensor, eps: float, expected: torch.Tensor
) -> torch.Tensor:
    """``bf16(c * rsqrt(mean(c^2) + eps) * w)`` when ``c`` may be off by ``prenorm_error``.

    The normalisation scales the collapse's error by ``|inv_rms w|``; the approximate
    rsqrt and the order of the sum of squares add a relative ``2^-21``; a few collapse
    elements one ulp apart move ``mean(c^2)`` by far less than ``2^-12`` relative, the
    slack allowed for it.
    """
    values = prenorm.float()
    inv_rms = torch.rsqrt((values * values).mean(-1, keepdim=True) + eps)
    scale = (inv_rms * weight.float()).abs()
    return bf16_ulp(expected) + scale * prenorm_error + (APPROX + 2.0**-12) * expected.float().abs()


def dsv41_collapse_error(
    residual_out: torch.Tensor, residual_tolerance: torch.Tensor, pre: torch.Tensor, collapse: torch.Tensor
) -> torch.Tensor:
    """``c = bf16(sum_j s_j pre_j)`` with each ``s_j`` within its tolerance: hc products."""
    hc = residual_out.shape[1]
    pre = pre.float().abs()[..., None]
    propagated = (residual_tolerance * pre).sum(1)
    magnitude = ((residual_out.float().abs() + residual_tolerance) * pre).sum(1)
    return bf16_ulp(collapse) + propagated + 2 * hc * U * magnitude


def gemv_tolerance(streams: torch.Tensor, fn: torch.Tensor, rstd: torch.Tensor, depth: int) -> torch.Tensor:
    """Raw mixes ``(fn @ s) rstd`` from the same BF16 streams, any two summation trees of ``depth``."""
    flat = streams.float().abs().reshape(streams.shape[0], -1)
    magnitude = flat @ fn.float().abs().t()
    return (2 * depth * U * magnitude + 2 * APPROX * magnitude) * rstd
