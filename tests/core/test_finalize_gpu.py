"""MoE finalize publish on the GPU: tp 1 and loopback tp 2, 4, 8, both weight dtypes."""

from __future__ import annotations

import pytest
import torch

from tests.support import (
    all_reduce_ranks,
    assert_bitwise_equal,
    assert_within,
    bf16_randn,
    bf16_ulp,
    poisoned,
    run_ranks,
)

pytestmark = pytest.mark.gpu

HIDDEN, TOP_K, CAPACITY = 4608, 8, 96


def finalize_ops(tp: int) -> list:
    return all_reduce_ranks(tp, HIDDEN, capacity=CAPACITY, top_k=TOP_K)


def make_moe(m: int, weight_dtype: torch.dtype, generator: torch.Generator):
    """~30 % of routes -1; token 0 has every route -1 and a -0 shared output."""
    from mhc_core import MoEOutput

    rows = 3 * m + 5
    index = torch.randint(0, rows, (m, TOP_K), generator=generator, device="cuda", dtype=torch.int32)
    dropped = torch.rand(m, TOP_K, generator=generator, device="cuda") < 0.3
    index[dropped] = -1
    index[0] = -1
    shared = bf16_randn(m, HIDDEN, generator=generator)
    shared[0] = -0.0
    return MoEOutput(
        gemm2_permuted=bf16_randn(rows, HIDDEN, generator=generator),
        expert_weights=torch.rand(m, TOP_K, generator=generator, device="cuda").to(weight_dtype),
        expanded_idx_to_permuted_idx=index.contiguous(),
        shared_output=shared,
    )


def finalize_tolerance(moe) -> torch.Tensor:
    """Per-rank bound between the kernel's publish value and the reference's.

    The kernel may contract ``acc + w * g`` into one FMA (one rounding instead of
    two) at each of the top_k steps: the FP32 accumulators differ by at most
    ``top_k`` FP32 ulps of the running magnitude, ``2 top_k 2^-24 S`` with
    ``S = |shared| + sum_k |w_k g_k|``; the BF16 rounding of either can then land
    one BF16 ulp apart.
    """
    from mhc_core import reference

    weights = moe.expert_weights.float()
    index = moe.expanded_idx_to_permuted_idx.long()
    magnitude = moe.shared_output.float().abs()
    for k in range(TOP_K):
        taken = (index[:, k] >= 0)[:, None]
        rows = moe.gemm2_permuted[index[:, k].clamp(min=0)].float().abs()
        magnitude = magnitude + torch.where(taken, weights[:, k : k + 1].abs() * rows, torch.zeros_like(rows))
    value = reference.finalize(
        moe.gemm2_permuted, moe.expert_weights, moe.expanded_idx_to_permuted_idx, moe.shared_output
    )
    return bf16_ulp(value) + 2 * TOP_K * 2.0**-24 * magnitude


@pytest.mark.parametrize("weight_dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("tp", (1, 2, 4, 8))
def test_finalize_matches_reference(tp: int, weight_dtype: torch.dtype) -> None:
    from mhc_core import reference

    ops = finalize_ops(tp)
    generator = torch.Generator("cuda").manual_seed(tp * 31 + (weight_dtype == torch.float32))
    for m in (1, 13, CAPACITY):
        moes = [make_moe(m, weight_dtype, generator) for _ in range(tp)]
        outs = [poisoned((m, HIDDEN), torch.bfloat16) for _ in range(tp)]
        results = run_ranks(ops, "call", [(moe,) for moe in moes], [dict(out=o) for o in outs])
        values = [
            reference.finalize(mo.gemm2_permuted, mo.expert_weights, mo.expanded_idx_to_permuted_idx, mo.shared_output)
            for mo in moes
        ]
        expected = reference.all_reduce(values)
        tolerance = bf16_ulp(expected) + sum(finalize_tolerance(mo) for mo in moes)
        for rank, result in enumerate(results):
            assert_within(result, expected, tolerance, f"tp {tp} rank {rank} M {m}")
            assert_bitwise_equal(result, results[0], f"rank {rank} vs rank 0")
        # Token 0 routes nothing and shares -0 on every rank: it publishes +0.
        assert (results[0][0].view(torch.int16) == 0).all()


def test_finalize_route_index_debug_mode() -> None:
    """check_routes: an index past the rows is skipped and reported at the next call."""
    from mhc_core import LamportAllReduce, MoEOutput, RouteIndexError

    op = LamportAllReduce(hidden_size=HIDDEN, max_num_tokens=8, device="cuda", top_k=TOP_K, check_routes=True)
    generator = torch.Generator("cuda").manual_seed(5)
    moe = make_moe(4, torch.float32, generator)
    index = moe.expanded_idx_to_permuted_idx.clone()
    index[2, 3] = moe.gemm2_permuted.shape[0] + 100
    bad = MoEOutput(moe.gemm2_permuted, moe.expert_weights, index, moe.shared_output)
    op(bad)
    torch.cuda.synchronize()
    with pytest.raises(RouteIndexError, match="token 2, route 3"):
        op.check()
    op(moe)  # the mailbox stayed consistent: the op keeps working
    op.check()
