"""``mhc_core.routing.MRangeDispatch``: the one rule for which kernel serves M tokens, and that the
op's selection and the native program's agree for every M (the ops' CPU programs with recorder
kernels, tests/core/test_launch_wiring_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from mhc_core.routing import MRangeDispatch, Route
from tests.core.test_launch_wiring_cpu import CAPACITY, HIDDEN, dsv_args, dsv_op, glm_args, glm_op


def test_select_takes_the_last_route_at_or_below_m() -> None:
    routing = MRangeDispatch.of((1, "a"), (4, "b"), (16, "c"))
    assert [routing.select(m) for m in (1, 3, 4, 15, 16, 1000)] == ["a", "a", "b", "b", "c", "c"]
    assert routing.thresholds == (1, 4, 16) and routing.targets == ("a", "b", "c") and len(routing) == 3


def test_of_lets_a_route_replace_an_earlier_one_of_the_same_threshold() -> None:
    assert MRangeDispatch.of((1, "default"), (1, "set")).routes == (Route(1, "set"),)


@pytest.mark.parametrize(
    ("routes", "error", "message"),
    [
        ((), ValueError, "at least one route"),
        ((Route(2, "a"),), ValueError, "start at 1 token, got min_tokens = 2"),
        ((Route(1, "a"), Route(4, "b"), Route(4, "c")), ValueError, r"increase strictly .* got \[1, 4, 4\]"),
        ((Route(1, "a"), Route(3, "b"), Route(2, "c")), ValueError, "increase strictly"),
        ((Route(1.0, "a"),), TypeError, "int min_tokens"),
    ],
)
def test_an_invalid_routing_is_refused(routes, error, message) -> None:
    with pytest.raises(error, match=message):
        MRangeDispatch(routes)


def test_m_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 token, got 0"):
        MRangeDispatch.of((1, "a")).select(0)


def test_glm_preset_routing_from_its_thresholds() -> None:
    from mhc_glm5.config import PERSISTENT, BoundaryTarget, boundary_routing

    routing = boundary_routing(((16, 2), (64, 8)), 256)
    assert routing.targets == (BoundaryTarget(1), BoundaryTarget(2), BoundaryTarget(8), PERSISTENT)
    assert routing.thresholds == (1, 16, 64, 256)
    assert [t.kernel_name for t in routing.targets] == ["boundary", "boundary_x2", "boundary_x8", "boundary_persistent"]
    assert boundary_routing((), 1).targets == (PERSISTENT,), "persistent from 1 token: every call"
    assert boundary_routing(((1, 2),), 0).targets == (BoundaryTarget(2),), "a threshold of 1 replaces one token"


def test_dsv_routing_from_its_threshold() -> None:
    from mhc_dsv41.config import CollectiveTarget, collective_routing

    assert collective_routing(384).routes == (Route(1, CollectiveTarget(False)), Route(384, CollectiveTarget(True)))
    assert collective_routing(1).targets == (CollectiveTarget(True),)


def test_the_glm_op_and_its_native_program_pick_the_same_kernel_for_every_m() -> None:
    op, kernels, _ = glm_op(1, cluster_tokens=((3, 2), (5, 4)), persistent_min_tokens=7)
    for m in range(1, CAPACITY + 1):
        op(torch.randn(m, HIDDEN).to(torch.bfloat16), *glm_args(m))
        launched = kernels.calls[-2][0]
        assert launched == op.routing.select(m).kernel_name, m
        assert op.boundary_kernel(m) is op._boundary_kernels[op.routing.select(m)]


def test_the_dsv_op_and_its_native_program_pick_the_same_collective_for_every_m() -> None:
    op, kernels = dsv_op(1)
    for m in range(1, CAPACITY + 1):
        op(torch.randn(m, HIDDEN).to(torch.bfloat16), *dsv_args(m))
        expected = "collective_persistent" if op.routing.select(m).persistent else "collective"
        assert kernels.calls[-1][0] == expected, m
