"""Outputs that are inputs (issue #32): vLLM's in-place habit, ``out=(residual, x)``. An output may
be exactly the parameter its rule names (residual_out the residual, the layer input x or the MoE
shared output) and overlaps nothing else: a partial overlap, an output that is another input, or two
outputs sharing memory are refused before any launch, naming both. Checked through the real native
programs on CPU tensors (``tests.core.test_launch_wiring_cpu``'s recorder kernels); the GPU tests
(``tests/lifecycle/test_in_place_gpu.py``) check the in-place values bitwise against fresh outputs."""

from __future__ import annotations

import pytest
import torch

from tests.core.test_launch_wiring_cpu import HC, HIDDEN, M, address, dsv_args, dsv_op, glm_args, glm_op, moe_fields


@pytest.mark.parametrize("tp", [1, 2])
def test_dsv_outputs_may_be_the_residual_and_x(tp: int) -> None:
    op, kernels = dsv_op(tp)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    args = dsv_args()
    residual = args[0]
    returned = op(x, *args, out=(residual, x))
    assert returned[0] is residual and returned[1] is x
    collective = kernels.calls[-1][1]
    assert collective["residual_out"] == address(residual) and collective["layer_input"] == address(x)


def test_dsv_finalize_layer_input_may_be_the_shared_output() -> None:
    op, kernels = dsv_op(2)
    gemm2, weights, index, shared = moe_fields()
    args = dsv_args()
    op.finalize(gemm2, weights, index, shared, *args, out=(args[0], shared))
    assert kernels.calls[-1][1]["layer_input"] == address(shared)


def _refused(op, kernels, call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
    assert kernels.calls == [], "a refused call launched"


def test_dsv_refuses_a_partial_overlap_with_the_residual() -> None:
    op, kernels = dsv_op(1)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    args = dsv_args()
    storage = torch.empty(M + 1, HC, HIDDEN, dtype=torch.bfloat16)
    storage[:M].copy_(args[0])
    residual, shifted = storage[:M], storage[1:]  # one token apart
    out = (shifted, torch.empty(M, HIDDEN, dtype=torch.bfloat16))
    call = lambda: op(x, residual, *args[1:], out=out)  # noqa: E731
    _refused(op, kernels, call, r"out\[0\] \(residual_out\): .*may only be residual itself.*overlapping residual")


def test_dsv_refuses_a_layer_input_inside_the_residual() -> None:
    op, kernels = dsv_op(2)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    args = dsv_args()
    inside = args[0].view(-1)[: M * HIDDEN].view(M, HIDDEN)  # the layer input written over residual streams
    out = (torch.empty(M, HC, HIDDEN, dtype=torch.bfloat16), inside)
    _refused(op, kernels, lambda: op(x, *args, out=out), r"out\[1\] \(layer_input\): .*overlapping residual")


def test_dsv_refuses_outputs_that_share_memory() -> None:
    op, kernels = dsv_op(1)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    residual_out = torch.empty(M, HC, HIDDEN, dtype=torch.bfloat16)
    layer_input = residual_out.view(-1)[: M * HIDDEN].view(M, HIDDEN)
    call = lambda: op(x, *dsv_args(), out=(residual_out, layer_input))  # noqa: E731
    _refused(op, kernels, call, r"out\[1\] \(layer_input\): .*overlapping out\[0\] \(residual_out\)")


def test_glm_outputs_may_be_the_residual_and_x_but_not_post_or_comb() -> None:
    op, kernels, _ = glm_op(1)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    args = glm_args()
    residual, post, comb = args[:3]
    fresh = lambda: (torch.empty(M, HC, 1), torch.empty(M, HC, HC))  # noqa: E731
    returned = op(x, *args, out=(residual, *fresh(), x))
    assert returned[0] is residual and returned[3] is x
    kernels.calls.clear()
    # The mixes kernel writes post_out and comb_out on the side stream while the boundary may still
    # read post and comb: never in place.
    call = lambda: op(x, *args, out=(residual, post, fresh()[1], x))  # noqa: E731
    _refused(op, kernels, call, r"out\[1\] \(post_out\): expected memory of its own, got a tensor overlapping post")
    call = lambda: op(x, *args, out=(residual, fresh()[0], comb, x))  # noqa: E731
    _refused(op, kernels, call, r"out\[2\] \(comb_out\): expected memory of its own, got a tensor overlapping comb")
