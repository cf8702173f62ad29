"""Which error report wins (issue #32): a timeout is never masked or cleared by a route report."""

from __future__ import annotations

import pytest
import torch

from tests.core.test_finalize_gpu import HIDDEN, TOP_K, make_moe
from tests.support import bf16_randn, build_ranks

pytestmark = pytest.mark.gpu


def test_a_route_report_queued_behind_a_timeout_does_not_mask_it() -> None:
    """Loopback tp 2, check_routes, a 200 ms bound: rank 0's first call times out (rank 1 never
    publishes) and a finalize with route -5 was already queued behind it. Every later check() and
    call raises the timeout; the finalize's outputs are NaN."""
    from mhc_core import LamportAllReduce, LamportTimeoutError, MoEOutput

    ops = build_ranks(
        2,
        lambda group: LamportAllReduce(
            hidden_size=HIDDEN, max_num_tokens=8, device="cuda", group=group, top_k=TOP_K, check_routes=True,
            spin_timeout_ms=200.0,
        ),
    )  # fmt: skip
    generator = torch.Generator("cuda").manual_seed(32)
    moe = make_moe(4, torch.float32, generator)
    index = moe.expanded_idx_to_permuted_idx.clone()
    index[1, 2] = -5
    bad = MoEOutput(moe.gemm2_permuted, moe.expert_weights, index, moe.shared_output)
    x = bf16_randn(4, HIDDEN, generator=generator)
    torch.cuda.synchronize()
    ops[0].publish(x)
    ops[0].collect()  # times out after 200 ms: rank 1 never publishes
    out = ops[0](bad)  # queued behind it; its publish reports route -5 after the timeout's report
    torch.cuda.synchronize()
    for attempt in range(3):
        with pytest.raises(LamportTimeoutError, match=r"ranks \[1\] never published") as caught:
            ops[0].check()
        assert caught.value.missing_ranks == (1,), attempt
    with pytest.raises(LamportTimeoutError, match=r"ranks \[1\]"):
        ops[0](x)
    assert torch.isnan(out).all(), "the finalize queued behind the timeout wrote numbers"


def test_a_route_report_alone_is_raised_once_and_the_op_keeps_working() -> None:
    from mhc_core import LamportAllReduce, MoEOutput, RouteIndexError, reference

    op = LamportAllReduce(hidden_size=HIDDEN, max_num_tokens=8, device="cuda", top_k=TOP_K, check_routes=True)
    generator = torch.Generator("cuda").manual_seed(33)
    moe = make_moe(4, torch.bfloat16, generator)
    index = moe.expanded_idx_to_permuted_idx.clone()
    index[3, 0] = -5
    op(MoEOutput(moe.gemm2_permuted, moe.expert_weights, index, moe.shared_output))
    torch.cuda.synchronize()
    with pytest.raises(RouteIndexError, match="token 3, route 0"):
        op.check()
    op.check()  # raised once
    x = bf16_randn(2, HIDDEN, generator=generator)
    assert torch.equal(op(x), reference.all_reduce([x]))
