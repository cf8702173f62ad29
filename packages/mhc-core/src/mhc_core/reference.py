"""Torch references that round where the kernels (and the seeds) round: the model-independent pieces
(the all-reduce, the MoE finalize, RMSNorm, the post-mix, Sinkhorn). Each model's boundary reference
lies in its package (its registry entry's ``reference``: ``<package>.reference``).

* The TP sum is FP32 in the kernel's exact tree (``tp_sum``), rounded to BF16.
* Each post-mixed stream is rounded to BF16 (``residual_out``), and the collapse
  reads those rounded streams.
* The collapse is rounded to BF16 before the RMSNorm; the norm output is
  ``bf16(collapse * inv_rms * weight)``.
* Everything else accumulates in FP32.

Where the kernels differ unavoidably (FMA contraction, the order of a cluster
reduction, approximate ``rsqrt``/``exp``/``rcp`` on the device against torch's
correctly rounded ones) the tests derive a tolerance; the TP sum itself matches
bit for bit.
"""

from __future__ import annotations

import torch

from .constants import NEGATIVE_ZERO_BF16


# ----------------------------------------------------------------- all-reduce
def tp_sum(partials: list[torch.Tensor], lanes: int = 1) -> torch.Tensor:
    """FP32 sum of BF16 partials in the kernels' tree (``mhc_core.device.protocol``).

    Lane ``l`` adds ranks ``l, l + lanes, ...`` in order (a lane with no rank holds
    zero); an xor butterfly then combines the lanes: for lanes = 2 at tp = 4 that is
    ``(r0 + r2) + (r1 + r3)``; lanes = 1 adds ranks one after another.
    """
    if lanes not in (1, 2, 4, 8):
        raise ValueError(f"lanes: expected 1, 2, 4 or 8, got {lanes}")
    values = [p.float() for p in partials]
    zero = torch.zeros_like(values[0])
    per_lane = []
    for lane in range(lanes):
        mine = values[lane::lanes]
        total = mine[0] if mine else zero
        for value in mine[1:]:
            total = total + value
        per_lane.append(total)
    step = 1
    while step < lanes:
        per_lane = [per_lane[lane] + per_lane[lane ^ step] for lane in range(lanes)]
        step *= 2
    return per_lane[0]


def sanitize(values: torch.Tensor) -> torch.Tensor:
    """BF16 with every -0 turned into +0, as the publish stores it."""
    bits = values.view(torch.int16)
    return torch.where(bits == NEGATIVE_ZERO_BF16 - 0x10000, torch.zeros_like(values), values)


def all_reduce(partials: list[torch.Tensor], lanes: int = 1) -> torch.Tensor:
    """What ``lamport_all_reduce`` returns on every rank: BF16 of the FP32 tree sum."""
    return tp_sum([sanitize(p) for p in partials], lanes).to(torch.bfloat16)


def finalize(
    gemm2_permuted: torch.Tensor,
    expert_weights: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    shared_output: torch.Tensor,
) -> torch.Tensor:
    """The MoE finalize publish's value: shared output first, then routes k ascending, FP32, BF16 out."""
    total = shared_output.float()
    weights = expert_weights.float()
    for k in range(expanded_idx_to_permuted_idx.shape[1]):
        index = expanded_idx_to_permuted_idx[:, k].long()
        taken = index >= 0
        rows = gemm2_permuted[index.clamp(min=0)].float()
        total = torch.where(taken[:, None], total + weights[:, k : k + 1] * rows, total)
    return sanitize(total.to(torch.bfloat16))


# ----------------------------------------------------------------- RMSNorm
def rms_norm(prenorm: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``bf16(prenorm * rsqrt(mean(prenorm^2) + eps) * weight)`` with prenorm already BF16."""
    values = prenorm.float()
    inv_rms = torch.rsqrt((values * values).sum(-1, keepdim=True) / values.shape[-1] + eps)
    return (values * inv_rms * weight.float()).to(torch.bfloat16)


def post_mix(reduced: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``bf16(x * post[j] + sum_i residual[i] * comb[i, j])`` per stream ``j``, sources in order."""
    x = reduced.float()
    streams = residual.float()
    post = post.reshape(post.shape[0], -1).float()
    comb = comb.float()
    hc = streams.shape[1]
    mixed = []
    for target in range(hc):
        value = x * post[:, target : target + 1]
        for source in range(hc):
            value = value + streams[:, source] * comb[:, source, target : target + 1]
        mixed.append(value)
    return torch.stack(mixed, dim=1).to(torch.bfloat16)


# ----------------------------------------------------------------- Sinkhorn
def sinkhorn(logits: torch.Tensor, eps: float, repeat: int) -> torch.Tensor:
    """The GLM seed's Sinkhorn on ``[..., 4, 4]`` logits, with exact division.

    Per row ``c = exp(c - max) / ((e0 + e1) + (e2 + e3)) + eps``; then ``repeat``
    rounds, from the second on dividing each row by ``((c0 + c1) + (c2 + c3)) + eps``,
    then each column likewise. The device function (``mhc_core.device.sinkhorn``) runs the same
    rounds in scaling form with ``rcp.approx``: equal in exact math, rounded differently.
    """
    c = logits.float()

    def pair_sum(v: torch.Tensor, dim: int) -> torch.Tensor:
        a, b, d, e = v.unbind(dim)
        return ((a + b) + (d + e)).unsqueeze(dim)

    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c * (1.0 / pair_sum(c, -1)) + eps
    for iteration in range(repeat):
        if iteration > 0:
            c = c * (1.0 / (pair_sum(c, -1) + eps))
        c = c * (1.0 / (pair_sum(c, -2) + eps))
    return c
