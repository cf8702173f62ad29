"""AllReduceMHC at tp 1: a plain call is one launch that reads x itself (no publish, no mailbox
traffic), bitwise the mailbox path's outputs; -0 inputs, poisoned outputs, fresh data per case."""

from __future__ import annotations

import pytest
import torch

from tests.support import assert_bitwise_equal, bf16_randn, poisoned

pytestmark = pytest.mark.gpu

HIDDEN, HC, TOP_K, CAPACITY, NORM_EPS = 5120, 4, 8, 160, 1e-6


@pytest.fixture(scope="module")
def op():
    from mhc_dsv41 import AllReduceMHC

    return AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=CAPACITY, device="cuda")


def collect_args(m: int, generator: torch.Generator) -> tuple:
    residual = bf16_randn(m, HC, HIDDEN, generator=generator)
    residual[0, 1] = -0.0
    post = torch.rand(m, HC, generator=generator, device="cuda") * 2
    comb = torch.softmax(torch.randn(m, HC, HC, generator=generator, device="cuda"), dim=-1)
    pre = torch.rand(m, HC, generator=generator, device="cuda")
    weight = (torch.rand(HIDDEN, generator=generator, device="cuda") + 0.5).to(torch.bfloat16)
    return residual, post, comb, pre, weight, NORM_EPS


def outs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return poisoned((m, HC, HIDDEN), torch.bfloat16), poisoned((m, HIDDEN), torch.bfloat16)


@pytest.mark.parametrize("m", (1, 7, CAPACITY))
def test_direct_call_is_bitwise_the_mailbox_path(op, m: int) -> None:
    generator = torch.Generator("cuda").manual_seed(100 + m)
    x = bf16_randn(m, HIDDEN, generator=generator)
    x[0] = -0.0  # a whole -0 row: the direct read must see +0, as a publish would have written
    x[-1, ::3] = -0.0
    args = collect_args(m, generator)
    torch.cuda.synchronize()
    stage = op.state.clone()
    direct = op(x, *args, out=outs(m))
    torch.cuda.synchronize()
    assert torch.equal(op.state, stage), "a direct call moved the stage on"
    op.publish(x)
    mailbox = op.collect(*args, out=outs(m), after_publish=True)
    for got, expected, name in zip(direct, mailbox, ("residual_out", "layer_input"), strict=True):
        assert_bitwise_equal(got, expected, name)
    assert not torch.equal(op.state, stage), "the mailbox path did not move the stage on"


def test_direct_call_launches_one_kernel(op) -> None:
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator("cuda").manual_seed(7)
    x, args = bf16_randn(3, HIDDEN, generator=generator), collect_args(3, generator)
    op(x, *args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        op(x, *args)
        torch.cuda.synchronize()
    names = [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [name for name in names if "Kernel" in name]
    assert len(kernels) == 1 and "LamportMHCKernel" in kernels[0], kernels


def test_finalize_keeps_the_mailbox_path(op) -> None:
    from mhc_core import MoEOutput

    generator = torch.Generator("cuda").manual_seed(8)
    m, rows = 5, 5 * TOP_K
    gemm2 = bf16_randn(rows, HIDDEN, generator=generator)
    weights = torch.rand(m, TOP_K, generator=generator, device="cuda")
    index = torch.randperm(rows, generator=generator, device="cuda").to(torch.int32).view(m, TOP_K)
    index[1, 2] = -1
    shared = bf16_randn(m, HIDDEN, generator=generator)
    args = collect_args(m, generator)
    torch.cuda.synchronize()
    stage = op.state.clone()
    finalized = op.finalize(gemm2, weights, index, shared, *args, out=outs(m))
    torch.cuda.synchronize()
    assert not torch.equal(op.state, stage), "finalize at tp 1 must publish (the top-k reduction)"
    op.publish(MoEOutput(gemm2, weights, index, shared))
    two_phase = op.collect(*args, out=outs(m), after_publish=True)
    called = op(MoEOutput(gemm2, weights, index, shared), *args, out=outs(m))
    for result in (two_phase, called):
        for got, expected, name in zip(result, finalized, ("residual_out", "layer_input"), strict=True):
            assert_bitwise_equal(got, expected, name)


def test_norm_eps_defaults_to_the_ops(op) -> None:
    """A call without ``norm_eps`` uses the op's (the preset's): bitwise the call that passes it."""
    generator = torch.Generator("cuda").manual_seed(9)
    x = bf16_randn(4, HIDDEN, generator=generator)
    residual, post, comb, pre, weight, _ = collect_args(4, generator)
    assert op.norm_eps == NORM_EPS
    implicit = op(x, residual, post, comb, pre, weight, out=outs(4))
    explicit = op(x, residual, post, comb, pre, weight, op.norm_eps, out=outs(4))
    other = op(x, residual, post, comb, pre, weight, 1e-2, out=outs(4))
    for got, expected, name in zip(implicit, explicit, ("residual_out", "layer_input"), strict=True):
        assert_bitwise_equal(got, expected, name)
    assert not torch.equal(other[1], explicit[1]), "an explicit norm_eps must still win"
