"""Bounded spins: a rank that never publishes makes its peers fail fast, not hang."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support import assert_bitwise_equal, bf16_randn, build_ranks, run_ranks

pytestmark = pytest.mark.gpu


def build(tp: int, timeout_ms: float | None):
    from mhc_core import LamportAllReduce

    return build_ranks(
        tp,
        lambda group: LamportAllReduce(
            hidden_size=4096, max_num_tokens=16, device="cuda", group=group, spin_timeout_ms=timeout_ms
        ),
    )


def test_missing_rank_is_reported_from_the_device_flag() -> None:
    from mhc_core import LamportTimeoutError, reference

    ops = build(4, 50.0)
    x = [bf16_randn(5, 4096) for _ in range(4)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for rank in (0, 1, 3):  # rank 2 never publishes
        ops[rank].publish(x[rank])
    for rank in (0, 1, 3):
        ops[rank].collect()
    torch.cuda.synchronize()  # returns: the kernels gave up on their own
    assert time.perf_counter() - start < 5.0
    for rank in (0, 1, 3):
        with pytest.raises(LamportTimeoutError, match=r"ranks \[2\] never published") as caught:
            ops[rank].check()
        assert caught.value.missing_ranks == (2,)
        with pytest.raises(LamportTimeoutError, match="rebuild it on every rank") as again:
            ops[rank](x[rank])
        assert again.value.missing_ranks == (2,)
    ops[2].check()  # rank 2 itself saw nothing wrong

    rebuilt = build(4, 50.0)
    results = run_ranks(rebuilt, "call", [(t,) for t in x])
    for result in results:
        assert_bitwise_equal(result, reference.all_reduce(x))


@pytest.mark.parametrize("tp", (1, 2, 4, 8))
def test_shipped_configuration_without_bound(tp: int) -> None:
    """spin_timeout_ms=0 (the bound off) passes the normal cases."""
    from mhc_core import reference

    ops = build(tp, 0)
    assert ops[0].spin.limit_ns == 0
    for m in (1, 16):
        x = [bf16_randn(m, 4096) for _ in range(tp)]
        for result in run_ranks(ops, "call", [(t,) for t in x]):
            assert_bitwise_equal(result, reference.all_reduce(x))
