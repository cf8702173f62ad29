"""MoE route indices outside [0, rows) (rows, rows + 7, -5) are dropped routes, like -1, whether or
not the op checks routes (LamportAllReduce with top_k = 4, AllReduceMHC.finalize and
AllReduceMhcBoundary with a MoEOutput; tp 1 and loopback tp 2). gemm2_permuted is a slice of a
tensor whose rows around it are NaN, so a route read anyway shows. check_routes=True gives the
same outputs and makes check() raise RouteIndexError."""

from __future__ import annotations

import pytest
import torch

from tests.dsv41.test_allreduce_mhc_gpu import NORM_EPS, check_outputs
from tests.dsv41.test_allreduce_mhc_gpu import inputs as dsv_inputs
from tests.glm5.checks import boundary_inputs, check_boundary
from tests.lifecycle.common import CORE, DSV, GLM, as_tuple, assert_results_equal
from tests.support import all_reduce_ranks, bf16_randn, build_ranks, run_ranks

pytestmark = pytest.mark.gpu

CAPACITY = 16
MARGIN = 8  # NaN rows on each side of gemm2_permuted: rows + 7 and -5 land in them
FAMILIES = {"core": CORE, "dsv41": DSV, "glm5": GLM}
_OPS: dict[tuple, list] = {}


def ops_for(family: str, tp: int, check_routes: bool) -> list:
    key = (family, tp, check_routes)
    if key not in _OPS:
        _OPS[key] = build_ranks(tp, lambda group: _build(family, tp, group, check_routes))
    return _OPS[key]


def _build(family: str, tp: int, group, check_routes: bool):
    if family == "core":
        from mhc_core import LamportAllReduce

        return LamportAllReduce(
            hidden_size=4096, max_num_tokens=CAPACITY, device="cuda", group=group, top_k=4, check_routes=check_routes
        )
    if family == "dsv41":
        from mhc_dsv41 import AllReduceMHC, presets

        preset = presets.get(f"h200-tp{tp}-h5120").PRESET
        return AllReduceMHC.from_config(
            preset, max_num_tokens=CAPACITY, device="cuda", group=group, check_routes=check_routes
        )
    from mhc_glm5 import AllReduceMhcBoundary, presets

    preset = presets.get(f"h200-tp{tp}-h4096").PRESET
    return AllReduceMhcBoundary.from_config(
        preset, max_num_tokens=CAPACITY, device="cuda", group=group, check_routes=check_routes
    )


def moe_pair(op, m: int, weight_dtype: torch.dtype, generator: torch.Generator) -> tuple:
    """One rank's MoE output with out-of-range routes, and the same with those routes -1."""
    from mhc_core import MoEOutput

    rows, hidden, top_k = 2 * m + 3, op.hidden_size, op.top_k
    padded = torch.full((rows + 2 * MARGIN, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm2 = padded[MARGIN : MARGIN + rows]
    gemm2.copy_(bf16_randn(rows, hidden, generator=generator))
    index = torch.randint(0, rows, (m, top_k), generator=generator, device="cuda", dtype=torch.int32)
    index[torch.rand(m, top_k, generator=generator, device="cuda") < 0.3] = -1
    index[0, 0] = rows
    index[m // 2, top_k - 1] = rows + 7
    index[m - 1, 1] = -5
    dropped = torch.where((index < 0) | (index >= rows), torch.full_like(index, -1), index)
    weights = (torch.rand(m, top_k, generator=generator, device="cuda") / top_k).to(weight_dtype)
    shared = bf16_randn(m, hidden, generator=generator)
    return MoEOutput(gemm2, weights, index, shared), MoEOutput(gemm2, weights, dropped, shared)


def call(family: str, ops: list, moes: list, shared) -> list:
    """Every rank's call with its MoE output (GLM: then each op's join()); ``shared``: the other inputs."""
    if family == "core":
        return run_ranks(ops, "call", [(moe,) for moe in moes])
    if family == "dsv41":
        args = [
            (moe.gemm2_permuted, moe.expert_weights, moe.expanded_idx_to_permuted_idx, moe.shared_output,
             *shared, NORM_EPS)
            for moe in moes
        ]  # fmt: skip
        return run_ranks(ops, "finalize", args)
    results = run_ranks(ops, "call", [(moe, *shared.values()) for moe in moes])
    for op in ops:
        op.join()
    return results


def check_against_reference(family: str, ops: list, results: list, dropped: list, shared) -> None:
    """DSV / GLM: the existing suites' checks, with the reduced x of the same finalize publish fed
    the routes as -1 (a LamportAllReduce of the op's rank lanes: bit-identical)."""
    torch.cuda.synchronize()
    op = ops[0]
    if family == "dsv41":
        all_reduce = all_reduce_ranks(op.tp, op.hidden_size, capacity=CAPACITY, top_k=op.top_k)
        reduced = run_ranks(all_reduce, "call", [(moe,) for moe in dropped])[0]
        check_outputs(results, reduced, *shared)
    elif family == "glm5":
        raw_mixes = [rank_op.raw_mixes[: dropped[0].shared_output.shape[0]].clone() for rank_op in ops]
        all_reduce = all_reduce_ranks(op.tp, op.hidden_size, capacity=CAPACITY, top_k=op.top_k, lanes=4)
        reduced = run_ranks(all_reduce, "call", [(moe,) for moe in dropped])[0]
        check_boundary(op, results, reduced, shared, raw_mixes)


def shared_inputs(family: str, op, m: int, generator: torch.Generator):
    if family == "dsv41":
        return dsv_inputs(m, op.hc_mult, op.hidden_size, generator, post_3d=False, negative_zero=False)
    if family == "glm5":
        return boundary_inputs(m, op.hidden_size, generator)
    return ()


def cases(op) -> list[tuple[int, torch.dtype]]:
    return [(m, dtype) for m in (1, 13) for dtype in op.weight_dtypes]


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("family", tuple(FAMILIES))
def test_out_of_range_routes_are_dropped(family: str, tp: int) -> None:
    ops = ops_for(family, tp, check_routes=False)
    generator = torch.Generator("cuda").manual_seed(tp * 10 + len(family))
    for m, dtype in cases(ops[0]):
        bad, dropped = zip(*(moe_pair(op, m, dtype, generator) for op in ops), strict=True)
        shared = shared_inputs(family, ops[0], m, generator)
        results = call(family, ops, list(bad), shared)
        torch.cuda.synchronize()
        for op in ops:
            op.check()  # without check_routes nothing is reported
        for rank, result in enumerate(results):
            for tensor in as_tuple(result):
                assert not tensor.isnan().any(), f"M {m} {dtype} rank {rank}: a dropped route was read"
        if family == "core":
            # The same op fed the routes as -1: bitwise the same.
            assert_results_equal(CORE, results, call(family, ops, list(dropped), shared), f"M {m} {dtype}")
        else:
            check_against_reference(family, ops, results, list(dropped), shared)


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("family", tuple(FAMILIES))
def test_check_routes_reports_them_and_still_drops_them(family: str, tp: int) -> None:
    from mhc_core import RouteIndexError

    ops = ops_for(family, tp, check_routes=True)
    model = FAMILIES[family]
    generator = torch.Generator("cuda").manual_seed(tp * 20 + len(family))
    for m, dtype in cases(ops[0]):
        bad, dropped = zip(*(moe_pair(op, m, dtype, generator) for op in ops), strict=True)
        shared = shared_inputs(family, ops[0], m, generator)
        results = call(family, ops, list(bad), shared)
        torch.cuda.synchronize()
        for op in ops:
            with pytest.raises(RouteIndexError):
                op.check()
        check_against_reference(family, ops, results, list(dropped), shared)
        expected = call(family, ops, list(dropped), shared)  # the op keeps working after the report
        torch.cuda.synchronize()
        for op in ops:
            op.check()
        assert_results_equal(model, results, expected, f"M {m} {dtype}: bad routes vs the same routes as -1")
