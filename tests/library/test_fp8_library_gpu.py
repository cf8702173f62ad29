"""The DSV FP8 custom ops (issue #33: ``mhc::dsv41_boundary_fp8``, ``dsv41_finalize_fp8``,
``dsv41_collect_fp8``) on the GPU, at tp 1, on two of ``tests/dsv41/test_fp8_op_gpu.py``'s ops (no
new kernel): packed UE8M0 scales (strided, their allocation past the view) beside the BF16 copy, and
MX scales alone.

* ``torch.compile(fullgraph=True)`` of a chain of boundaries, a finalize and a two-phase collect
  through ``mhc_dsv41.library``: one graph, every output bitwise the eager op's;
* ``torch.library.opcheck``: the schema, the fake implementations against the real outputs (sizes,
  strides, dtypes) and, for the standalone ops, AOT dispatch with M symbolic. opcheck compares FP8
  outputs bitwise (torch's default for float8), the others with its default tolerances (it drops a
  zero one); the compiled test above is the bitwise one.
"""

from __future__ import annotations

import pytest
import torch

from tests.dsv41.test_fp8_op_gpu import case, flat_bytes, fp8_ops, moe_inputs
from tests.support import assert_bitwise_equal

pytestmark = pytest.mark.gpu

OPS = (("ue8m0-g128-packed", True), ("mx-g32", False))
NORM_EPS = 1e-6
M = 5


def op_for(fmt: str, both: bool):
    return fp8_ops("h200-tp1-h5120", fmt, both, persistent=False)[0]


def assert_same(actual, expected, what: str) -> None:
    assert len(actual) == len(expected), what
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert (a.dtype, a.shape, a.stride()) == (e.dtype, e.shape, e.stride()), f"{what}: output {index}"
        if a.element_size() == 1:
            assert bool((flat_bytes(a) == flat_bytes(e)).all()), f"{what}: output {index} bytes"
        else:
            assert_bitwise_equal(a, e, f"{what}: output {index}")


def layers(op, x, residual, post, comb, pre, weight, moe):
    """Two boundaries (the second fed the first's residual), a finalize and a publish / collect."""
    from mhc_core.host.library import publish_input
    from mhc_dsv41 import library

    first = library.boundary(op, x, residual, post, comb, pre, weight, NORM_EPS)
    second = library.boundary(op, x, first[0], post, comb, pre, weight, NORM_EPS)
    third = library.boundary(op, moe, second[0], post, comb, pre, weight, NORM_EPS)
    publish_input(op, x)
    return [first, second, third, library.collect(op, third[0], post, comb, pre, weight, NORM_EPS)]


def eager(op, x, residual, post, comb, pre, weight, moe):
    first = op(x, residual, post, comb, pre, weight, NORM_EPS)
    second = op(x, first[0], post, comb, pre, weight, NORM_EPS)
    third = op(moe, second[0], post, comb, pre, weight, NORM_EPS)
    op.publish(x)
    return [first, second, third, op.collect(third[0], post, comb, pre, weight, NORM_EPS)]


@pytest.mark.parametrize(("fmt", "both"), OPS)
def test_compiled_equals_eager_bitwise(fmt: str, both: bool) -> None:
    op = op_for(fmt, both)
    generator = torch.Generator("cuda").manual_seed(3)
    (x,), shared = case([op], M, generator)
    (moe,) = moe_inputs([op], M, generator)
    torch._dynamo.reset()
    compiled = torch.compile(layers, fullgraph=True)
    actual = compiled(op, x, *shared, moe)
    expected = eager(op, x, *shared, moe)
    torch.cuda.synchronize()
    assert len(actual) == len(expected) == 4
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert isinstance(a, tuple) and len(a) == (4 if both else 3)
        assert_same(a, e, f"{fmt} compiled, call {index}")


def mhc(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.mhc, name).default


@pytest.mark.parametrize(("fmt", "both"), OPS)
def test_opcheck(fmt: str, both: bool) -> None:
    op = op_for(fmt, both)
    generator = torch.Generator("cuda").manual_seed(4)
    (x,), shared = case([op], M, generator)
    (moe,) = moe_inputs([op], M, generator)
    option = (fmt, both)
    standalone = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    boundary = (op.state, op.handle, x, *shared, NORM_EPS, *option)
    torch.library.opcheck(mhc("dsv41_boundary_fp8"), boundary, test_utils=standalone)
    routed = (moe.gemm2_permuted, moe.expert_weights, moe.expanded_idx_to_permuted_idx, moe.shared_output)
    finalize = (op.state, op.handle, *routed, *shared, NORM_EPS, *option)
    torch.library.opcheck(mhc("dsv41_finalize_fp8"), finalize, test_utils=standalone)
    # The two phases, one sub-test at a time (each calls the op once): a publish before each collect.
    for test in ("test_schema", "test_faketensor"):
        torch.library.opcheck(mhc("publish"), (op.state, op.handle, x), test_utils=test)
        collect = (op.state, op.handle, *shared, NORM_EPS, *option)
        torch.library.opcheck(mhc("dsv41_collect_fp8"), collect, test_utils=test)


def test_a_call_for_another_format_is_refused() -> None:
    op = op_for("mx-g32", False)
    generator = torch.Generator("cuda").manual_seed(5)
    (x,), shared = case([op], M, generator)
    with pytest.raises(ValueError, match=r"layer_input_format: the op behind handle \d+ writes 'mx-g32'"):
        torch.ops.mhc.dsv41_boundary_fp8(op.state, op.handle, x, *shared, NORM_EPS, "mx-g32", True)
    op.check()  # refused before any launch: the op is fine
