"""Checking AllReduceMhcBoundary's four outputs (and its raw mixes) against mhc_glm5.reference (and
mhc_core.reference's model-independent pieces)."""

from __future__ import annotations

import torch

from tests.support import assert_bitwise_equal, assert_within, bf16_randn, bf16_ulp
from tests.tolerances import APPROX, U, gemv_tolerance, post_mix_tolerance, rms_norm_tolerance

HC, MIX = 4, 24


def boundary_inputs(m: int, hidden: int, generator: torch.Generator, *, negative_zero: bool = False) -> dict:
    """Weights and mixes in GLM's ranges; ``negative_zero`` puts -0.0 into a residual row."""
    residual = bf16_randn(m, HC, hidden, generator=generator)
    if negative_zero:
        residual[0, 1] = -0.0
    return dict(
        residual=residual,
        post=(torch.rand(m, HC, 1, generator=generator, device="cuda") * 2).contiguous(),
        comb=torch.softmax(torch.randn(m, HC, HC, generator=generator, device="cuda"), dim=-1),
        fn=(torch.randn(MIX, HC * hidden, generator=generator, device="cuda") * 0.02).to(torch.bfloat16),
        scale=torch.rand(3, generator=generator, device="cuda") + 0.5,
        base=torch.randn(MIX, generator=generator, device="cuda"),
        norm_weight=(torch.rand(hidden, generator=generator, device="cuda") + 0.5).to(torch.bfloat16),
    )


def gemv_depth(op) -> int:
    """FP32 additions on the longest path of the op's GEMV trees (the deepest of its kernels).

    CUDA-core kernels: 8 per fragment, 5 over a warp, one per warp, one per cluster peer.
    Tensor-core kernel (8 / 16 tokens per cluster): ``mma.sync`` does not document the order
    or rounding of its internal sum, so every one of its 16 products plus the accumulator
    counts as an add, doubled for truncation instead of rounding to nearest, over the 16
    MMAs of a warp (8 fragments x 2 k-halves); then one per warp and one per cluster peer.
    """
    from mhc_glm5.config import MMA_TOKENS

    warps, cluster = op.preset.threads // 32, op.preset.cluster_size
    depth = 8 + 5 + warps + cluster
    if any(tokens in MMA_TOKENS for tokens in op.preset.grouped_sizes):
        depth = max(depth, 2 * 16 * 17 + warps + cluster)
    return depth


def check_boundary(op, results: list, reduced: torch.Tensor, args: dict, raw_mixes: list[torch.Tensor]) -> None:
    """Every rank's outputs within the derived tolerances; all ranks bitwise identical.

    ``reduced`` is the all-reduced BF16 x (the reference's, bit-exact with the
    kernel's tree). The raw mixes, pre-mix and collapse are checked from the
    kernel's own BF16 streams, so a one-ulp stream difference is not counted twice.
    """
    from mhc_core import reference
    from mhc_glm5 import reference as glm5_reference

    preset = op.preset
    residual, post, comb, fn = args["residual"], args["post"], args["comb"], args["fn"]
    scale, base, weight = args["scale"], args["base"], args["norm_weight"]
    expected_residual = reference.post_mix(reduced, residual, post, comb)
    residual_tolerance = post_mix_tolerance(reduced, residual, post, comb, expected_residual)

    residual_out = results[0][0]
    streams = residual_out.float()
    flat = streams.reshape(streams.shape[0], -1)
    rstd = torch.rsqrt((flat * flat).sum(-1, keepdim=True) / flat.shape[1] + preset.rms_eps)
    raw = glm5_reference.glm5_mixes(residual_out, fn, preset.rms_eps)
    raw_tolerance = gemv_tolerance(residual_out, fn, rstd, gemv_depth(op)) + APPROX * raw.abs()

    pre = glm5_reference.sigmoid(raw[:, :HC] * scale[0] + base[:HC]) + preset.hc_eps
    pre_error = 0.25 * scale[0].abs() * raw_tolerance[:, :HC] + 2 * APPROX
    t = streams * pre[..., None]
    collapse = ((t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3])).to(torch.bfloat16)
    collapse_error = (
        bf16_ulp(collapse)
        + (streams.abs() * pre_error[..., None]).sum(1)
        + 2 * 3 * U * (streams.abs() * (pre.abs() + pre_error)[..., None]).sum(1)
    )
    expected_input = reference.rms_norm(collapse, weight, preset.norm_eps)
    input_tolerance = rms_norm_tolerance(collapse, collapse_error, weight, preset.norm_eps, expected_input)

    expected_post, expected_comb = glm5_reference.glm5_side_mixes(
        raw, scale, base, hc_eps=preset.hc_eps, post_mult=preset.post_mult, sinkhorn_repeat=preset.sinkhorn_repeat
    )
    post_tolerance = preset.post_mult * (0.25 * scale[1].abs() * raw_tolerance[:, HC : 2 * HC] + 2 * APPROX)
    logit_error = (scale[2].abs() * raw_tolerance[:, 2 * HC :]).amax(-1)[:, None, None]
    # Sinkhorn preserves relative perturbations: a logit error d moves each entry by at
    # most a factor e^(2d) per normalisation pair; rcp.approx adds 2^-22 per step.
    comb_tolerance = expected_comb.abs() * (4 * logit_error + 2 * (2 * preset.sinkhorn_repeat + 1) * 2.0**-22) + 1e-9

    for rank, (rank_residual, rank_post, rank_comb, rank_input) in enumerate(results):
        assert_within(rank_residual, expected_residual, residual_tolerance, f"rank {rank} residual_out")
        assert_within(raw_mixes[rank], raw, raw_tolerance, f"rank {rank} raw mixes")
        assert_within(rank_input, expected_input, input_tolerance, f"rank {rank} layer_input")
        assert_within(rank_post, expected_post, post_tolerance[..., None], f"rank {rank} post_out")
        assert_within(rank_comb, expected_comb, comb_tolerance, f"rank {rank} comb_out")
        for name, mine, first in zip(
            ("residual_out", "post_out", "comb_out", "layer_input"), results[rank], results[0], strict=True
        ):
            assert_bitwise_equal(mine, first, f"rank {rank} {name} vs rank 0")
        assert_bitwise_equal(raw_mixes[rank], raw_mixes[0], f"rank {rank} raw mixes vs rank 0")
