"""``mhc_core.device.handoff`` on the GPU: the producer stores every FP32 pattern but -0 unchanged, the
consumer takes a row once no -0 remains and re-arms it, and gives up on a row never written."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

NEGATIVE_ZERO = -(2**31)


def bound(role: str):
    from mhc_core.host.binaries.compiler import compile_kernel, device_arch
    from mhc_core.host.binaries.launch import BoundKernel
    from tests.core.handoff_kernel import HandoffConfig, HandoffKernel

    kernel = HandoffKernel(HandoffConfig(role))
    return BoundKernel(compile_kernel(kernel, device_arch()).function, kernel.signature(), {})


def bit_patterns(n: int) -> torch.Tensor:
    """Random FP32 bit patterns with -0, +0, infinities, NaNs and denormals among them."""
    generator = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=generator, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([NEGATIVE_ZERO, 0, 0x7F800000, -0x00800000, 0x7FC00000, -1, 1, -(2**31) + 1])
    bits[: specials.numel()] = specials.to(torch.int32)
    bits[specials.numel() :: 7] = NEGATIVE_ZERO
    return bits


def test_rows_round_trip_with_negative_zero_as_plus_zero() -> None:
    from mhc_core.host.calls.spin import SpinGuard

    rows_count, width = 1000, 8
    bits = bit_patterns(rows_count * width).view(rows_count, width).cuda()
    rows = torch.full((rows_count, width), -0.0, device="cuda")
    out = torch.full((rows_count, width), float("nan"), device="cuda")
    guard = SpinGuard(tp=1, timeout_ms=1000.0, device=torch.device("cuda"))
    state = torch.zeros(4, dtype=torch.int32, device="cuda")  # a stage state: NEXT, ERROR, ACTIVE, ERROR
    spin = dict(spin_limit_ns=guard.limit_ns, error_flag=guard.address, state=state.data_ptr())
    bound("write")(values=bits.view(torch.float32), rows=rows, out=out, n=rows_count, **spin)
    torch.cuda.synchronize()
    expected = torch.where(bits == NEGATIVE_ZERO, torch.zeros_like(bits), bits)
    assert torch.equal(rows.view(torch.int32), expected), "the producer changes -0 only"
    bound("take")(values=bits.view(torch.float32), rows=rows, out=out, n=rows_count, **spin)
    torch.cuda.synchronize()
    guard.check()
    assert torch.equal(out.view(torch.int32), expected)
    assert (rows.view(torch.int32) == NEGATIVE_ZERO).all(), "the consumer re-arms every slot"


def test_consumer_gives_up_on_a_row_never_written() -> None:
    from mhc_core import LamportTimeoutError
    from mhc_core.host.calls.spin import SpinGuard

    rows = torch.full((3, 8), -0.0, device="cuda")
    rows[1, :7] = 1.0  # one slot of row 1 still empty
    rows[2] = 2.0
    out = torch.full((3, 8), float("nan"), device="cuda")
    guard = SpinGuard(tp=1, timeout_ms=20.0, device=torch.device("cuda"))
    state = torch.zeros(4, dtype=torch.int32, device="cuda")  # a stage state: NEXT, ERROR, ACTIVE, ERROR
    spin = dict(spin_limit_ns=guard.limit_ns, error_flag=guard.address, state=state.data_ptr())
    bound("take")(values=out, rows=rows, out=out, n=3, **spin)
    torch.cuda.synchronize()  # returns: the kernel gave up on its own
    assert out[:2].isnan().all() and (out[2] == 2.0).all()
    assert state.tolist() == [0, 3, 0, 3], "a hand-off timeout sets both copies of the op's error word"
    with pytest.raises(LamportTimeoutError, match="hand-off row"):
        guard.check()
