"""Outputs written in place (issue #32): ``out=(residual, x)`` (vLLM's ``fused_add_rms_norm``
habit) gives, bitwise, what fresh outputs give, for every kernel variant (one-token, grouped on
CUDA cores and tensor cores, persistent) at tp 1 and loopback tp 2, 4, 8; LamportAllReduce with
``out=x`` too. Each rank owns its inputs (in place, a rank overwrites them), -0 among them."""

from __future__ import annotations

import pytest
import torch

from tests.lifecycle.common import CORE, DSV, GLM, core_ops, dsv_ops, glm_ops, poison_all
from tests.support import assert_bitwise_equal, run_ranks

pytestmark = pytest.mark.gpu

TPS = (1, 2, 4, 8)
#: DSV: the one-token collective below 384, the persistent one from it.
DSV_M = (1, 37, 400)
#: GLM tp 1: one-token, x8 (tensor cores), x16, persistent (from 256); tp 2-8: one-token, x2 and x4
#: (CUDA cores), x8, x16.
GLM_M = (1, 20, 40, 100, 200, 300)
CAPACITY = 400


def _own(args: tuple) -> tuple:
    """A rank's own copy of its call's arguments (in place, a rank overwrites them)."""
    return tuple(value.clone() if isinstance(value, torch.Tensor) else value for value in args)


def _fresh_then_in_place(model, ops, m: int, in_place_out) -> None:
    generator = torch.Generator("cuda").manual_seed(1000 + 10 * len(ops) + m)
    case = model.case(ops, m, generator, negative_zero=True)
    args = [_own(model.rank_args(case, rank)) for rank in range(len(ops))]
    fresh = model.outputs(ops, m)
    poison_all(fresh)
    fresh = run_ranks(ops, "call", args, [dict(out=o) for o in fresh])
    if model.glm:
        for op in ops:
            op.join()
    mine = [_own(rank_args) for rank_args in args]
    outs = [in_place_out(rank_args, m) for rank_args in mine]
    results = run_ranks(ops, "call", mine, [dict(out=o) for o in outs])
    if model.glm:
        for op in ops:
            op.join()
    torch.cuda.synchronize()
    for rank, (expected, actual, out) in enumerate(zip(fresh, results, outs, strict=True)):
        expected = expected if isinstance(expected, tuple) else (expected,)
        actual = actual if isinstance(actual, tuple) else (actual,)
        for index, (a, b, given) in enumerate(
            zip(actual, expected, out if isinstance(out, tuple) else (out,), strict=True)
        ):
            assert a is given, f"rank {rank} output {index}: not the tensor passed"
            assert_bitwise_equal(a, b, f"M = {m}, rank {rank}, output {index} in place vs fresh")


@pytest.mark.parametrize("tp", TPS)
def test_all_reduce_out_is_x(tp: int) -> None:
    ops = core_ops(tp, CAPACITY)
    for m in (1, 37, 400):
        _fresh_then_in_place(CORE, ops, m, lambda args, m: args[0])


@pytest.mark.parametrize("tp", TPS)
def test_dsv_out_is_residual_and_x(tp: int) -> None:
    ops = dsv_ops(f"h200-tp{tp}-h5120", CAPACITY)
    for m in DSV_M:
        _fresh_then_in_place(DSV, ops, m, lambda args, m: (args[1], args[0]))


@pytest.mark.parametrize("tp", TPS)
def test_glm_out_is_residual_and_x(tp: int) -> None:
    ops = glm_ops(f"h200-tp{tp}-h4096", CAPACITY)
    hc = 4

    def in_place(args, m):
        return (
            args[1],
            torch.empty(m, hc, 1, dtype=torch.float32, device="cuda"),
            torch.empty(m, hc, hc, dtype=torch.float32, device="cuda"),
            args[0],
        )

    for m in GLM_M:
        _fresh_then_in_place(GLM, ops, m, in_place)
