"""lamport_all_reduce on the GPU: tp 1 and loopback tp 2, 4, 8, bit-exact against the reference."""

from __future__ import annotations

import pytest
import torch

from tests.support import (
    all_reduce_ranks,
    assert_bitwise_equal,
    bf16_randn,
    is_poisoned,
    negative_zeros,
    poisoned,
    run_ranks,
)

pytestmark = pytest.mark.gpu

CAPACITY = 160
TPS = (1, 2, 4, 8)
HIDDENS = (2560, 4096, 4608, 7168)


def all_reduce_ops(tp: int, hidden: int, *, lanes: int = 1, capacity: int = CAPACITY) -> list:
    return all_reduce_ranks(tp, hidden, capacity=capacity, lanes=lanes)


def check_all_reduce(ops: list, partials: list[torch.Tensor], lanes: int = 1) -> list[torch.Tensor]:
    from mhc_core import reference

    outs = [poisoned(p.shape, torch.bfloat16) for p in partials]
    results = run_ranks(ops, "call", [(p,) for p in partials], [dict(out=o) for o in outs])
    expected = reference.all_reduce(partials, lanes)
    for rank, (result, out) in enumerate(zip(results, outs, strict=True)):
        assert result.data_ptr() == out.data_ptr()
        assert_bitwise_equal(result, expected, f"rank {rank}")
        assert not is_poisoned(result).any()
    for rank, result in enumerate(results[1:], start=1):
        assert_bitwise_equal(result, results[0], f"rank {rank} vs rank 0")
    return results


@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("tp", TPS)
def test_matches_reference_bitwise(tp: int, hidden: int) -> None:
    ops = all_reduce_ops(tp, hidden)
    generator = torch.Generator("cuda").manual_seed(tp * 100003 + hidden)
    for m in (1, 7, 64, CAPACITY):
        partials = [bf16_randn(m, hidden, generator=generator) for _ in range(tp)]
        check_all_reduce(ops, partials)


@pytest.mark.parametrize("lanes", (2, 4, 8))
def test_rank_lanes_tree(lanes: int) -> None:
    """With rank lanes the sum is a fixed butterfly tree; the reference builds the same one."""
    ops = all_reduce_ops(8, 4096, lanes=lanes)
    generator = torch.Generator("cuda").manual_seed(lanes)
    # Large dynamic range so that a different summation order would show.
    partials = [bf16_randn(13, 4096, generator=generator, scale=10.0 ** (r % 4)) for r in range(8)]
    check_all_reduce(ops, partials, lanes=lanes)


@pytest.mark.parametrize("tp", TPS)
def test_negative_zero_inputs_never_hang_never_return_negative_zero(tp: int) -> None:
    ops = all_reduce_ops(tp, 4608)
    partials = [negative_zeros(CAPACITY, 4608) for _ in range(tp)]
    results = check_all_reduce(ops, partials)
    for result in results:
        assert (result.view(torch.int16) == 0).all(), "the sum of -0 partials must publish and return +0"


@pytest.mark.parametrize("tp", (1, 4))
def test_hundred_consecutive_calls(tp: int) -> None:
    """Generations wrap many times; every call sees fresh data."""
    ops = all_reduce_ops(tp, 2560)
    generator = torch.Generator("cuda").manual_seed(7)
    for call in range(100):
        m = 1 + (call * 37) % CAPACITY
        partials = [bf16_randn(m, 2560, generator=generator) for _ in range(tp)]
        check_all_reduce(ops, partials)


def test_cuda_graph_replayed_1000_times() -> None:
    from mhc_core import reference

    tp, hidden, m = 4, 4096, 7
    ops = all_reduce_ops(tp, hidden)
    partials = [torch.zeros(m, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]
    outs = [poisoned((m, hidden), torch.bfloat16) for _ in range(tp)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_ranks(ops, "call", [(p,) for p in partials], [dict(out=o) for o in outs])
    generator = torch.Generator("cuda").manual_seed(1000)
    for replay in range(1000):
        for partial in partials:
            partial.copy_(bf16_randn(m, hidden, generator=generator))
        for out in outs:
            out.view(torch.int16).fill_(0x7FA5)
        graph.replay()
        expected = reference.all_reduce(partials)
        for rank, out in enumerate(outs):
            assert_bitwise_equal(out, expected, f"replay {replay}, rank {rank}")


def test_collective_really_spins_until_a_late_publish() -> None:
    """Rank 0's collective is enqueued before rank 1's publish (other stream, behind a sleep)."""
    from mhc_core import reference

    ops = all_reduce_ops(2, 4096)
    generator = torch.Generator("cuda").manual_seed(3)
    partials = [bf16_randn(3, 4096, generator=generator) for _ in range(2)]
    early, late = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda._sleep(1)  # load the sleep kernel's module now: loading waits behind a spinning kernel
    torch.cuda.synchronize()
    start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(early):
        start.record()
        ops[0].publish(partials[0])
        out0 = ops[0].collect(after_publish=True)
        done.record()
    with torch.cuda.stream(late):
        torch.cuda._sleep(100_000_000)  # ~50 ms at H200 clocks
        ops[1].publish(partials[1])
        out1 = ops[1].collect(after_publish=True)
    torch.cuda.synchronize()
    expected = reference.all_reduce(partials)
    assert_bitwise_equal(out0, expected, "rank 0 (waited)")
    assert_bitwise_equal(out1, expected, "rank 1")
    assert start.elapsed_time(done) > 10.0, "rank 0's collective returned before rank 1 published"


def test_bit_tricks_on_all_65536_patterns_through_the_op() -> None:
    """Every BF16 pattern through publish (sanitise) and collective (poll, sum, round) at tp = 1."""
    ops = all_reduce_ops(1, 4096, capacity=CAPACITY)
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(16, 4096).cuda()
    x = patterns.view(torch.bfloat16)
    out = ops[0](x)
    torch.cuda.synchronize()
    raw = patterns.to(torch.int32) & 0xFFFF
    is_nan = ((raw & 0x7F80) == 0x7F80) & ((raw & 0x007F) != 0)
    expected = torch.where(raw == 0x8000, torch.zeros_like(raw), raw)
    got = out.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(got[~is_nan], expected[~is_nan])
    got_nan = ((got & 0x7F80) == 0x7F80) & ((got & 0x007F) != 0)
    assert got_nan[is_nan].all()
