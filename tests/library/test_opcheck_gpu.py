"""``torch.library.opcheck`` on every ``torch.ops.mhc`` custom op, at tp 1 (the models' ops built from
the presets ``h200-tp1-h5120`` and ``h200-tp1-h4096``, the all-reduce from ``LamportAllReduce``).

What opcheck runs (``torch.testing._internal.optests``, torch 2.11 to 2.13) and where it applies:

* ``test_schema``: one call on cloned inputs under ``SchemaCheckMode``: no input is mutated that the
  schema does not declare mutated, no output aliases an input or another output. Every op. (It cannot
  see the declared mutation itself: the kernels advance the op's own state, the argument is a clone.)
* ``test_autograd_registration``: left out everywhere. It checks where the autograd formula of an op
  that trains is registered; these ops are for inference and have none, by design. opcheck runs it only
  when an input requires grad, and then it passes on the Autograd kernel ``torch.library.custom_op``
  registers for every op (one that raises on backward): nothing of ours to check.
* ``test_faketensor``: one call on real tensors, one through the fake implementation; every output's
  size, strides, dtype and device compared. Every op.
* ``test_aot_dispatch_dynamic``: the op eagerly, then traced by AOTAutograd (functionalised, M
  symbolic) and run: two calls in a row with the same inputs, outputs compared. Only where a call
  stands alone.

Order: every call moves the op's mailbox generation on, so what opcheck calls must be legal calls in
a row. A call of the all-reduce, a DSV boundary or finalize, or a GLM boundary stands alone (plain
and MoE input): all three sub-tests. The two-phase ops cannot be checked one at a time: a publish
must be followed by its collect, a GLM boundary or collect by its join. ``test_schema`` and
``test_faketensor`` call the op once each, so they run one sub-test at a time with the phases
interleaved. ``test_aot_dispatch_dynamic`` calls the op twice in a row, which no two-phase op allows
(a second collect has no publish pending, a second join no boundary to join; a publish returns
nothing, so AOTAutograd would see only its state mutation): each whole sequence goes through AOT
dispatch instead (``torch.compile(backend="aot_eager", dynamic=True)``), equal to eager bitwise and
moving the op's mailbox generation as eager does.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.utils._pytree as pytree

from mhc_core.constants import NEXT_STAGE
from tests.dsv41.test_allreduce_mhc_gpu import NORM_EPS
from tests.dsv41.test_allreduce_mhc_gpu import inputs as dsv_inputs
from tests.glm5.checks import boundary_inputs as glm_inputs
from tests.glm5.test_boundary_gpu import moe_inputs
from tests.lifecycle.common import core_ops, dsv_ops, glm_ops
from tests.support import assert_bitwise_equal, bf16_randn

pytestmark = pytest.mark.gpu

CAPACITY = 16
M = 5
STANDALONE = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
ONE_CALL_EACH = ("test_schema", "test_faketensor")
#: opcheck drops a zero tolerance (it tests ``rtol and atol``) for assert_close's defaults: the least
#: positive double asks for equal outputs (the two calls run the same kernels on the same inputs).
EQUAL = dict(atol=sys.float_info.min, rtol=sys.float_info.min)


@pytest.fixture(scope="module")
def ops():
    built = {
        "core": core_ops(1, CAPACITY, top_k=8)[0],
        "dsv41": dsv_ops("h200-tp1-h5120", CAPACITY)[0],
        "glm5": glm_ops("h200-tp1-h4096", CAPACITY)[0],
    }
    yield built
    for op in built.values():
        op.close()


def generator(seed: int) -> torch.Generator:
    return torch.Generator("cuda").manual_seed(seed)


def mhc(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.mhc, name).default


def publish_input(op, moe: bool, seed: int) -> tuple[str, tuple, torch.Tensor]:
    """(the publish op's name, its tensors after state and handle, a tensor shaped like the reduced x)."""
    if moe:
        routed = moe_inputs([op], M, torch.float32, generator(seed))[0]
        tensors = (routed.gemm2_permuted, routed.expert_weights, routed.expanded_idx_to_permuted_idx,
                   routed.shared_output)  # fmt: skip
        return "publish_moe", tensors, routed.shared_output
    x = bf16_randn(M, op.hidden_size, generator=generator(seed))
    x[-1] = -0.0
    return "publish", (x,), x


def after_x(family: str, op, seed: int) -> tuple:
    """The model's boundary inputs after x (DSV's end with norm_eps), -0.0 in the residual."""
    if family == "dsv41":
        shared = dsv_inputs(M, op.hc_mult, op.hidden_size, generator(seed), post_3d=False, negative_zero=True)
        return (*shared, NORM_EPS)
    return tuple(glm_inputs(M, op.hidden_size, generator(seed), negative_zero=True).values())


# ------------------------------------------------------------- standalone calls
@pytest.mark.parametrize("moe", [False, True], ids=["plain", "moe"])
def test_all_reduce(ops, moe: bool) -> None:
    op = ops["core"]
    _, tensors, _ = publish_input(op, moe, seed=1 + moe)
    name = "all_reduce_moe" if moe else "all_reduce"
    torch.library.opcheck(mhc(name), (op.state, op.handle, *tensors), test_utils=STANDALONE, **EQUAL)


@pytest.mark.parametrize("family", ["dsv41", "glm5"])
@pytest.mark.parametrize("moe", [False, True], ids=["plain", "moe"])
def test_boundary(ops, family: str, moe: bool) -> None:
    """DSV ``dsv41_boundary`` / ``dsv41_finalize``, GLM ``glm5_boundary`` / ``glm5_boundary_moe``
    (a GLM call joins the one before by itself)."""
    op = ops[family]
    _, tensors, _ = publish_input(op, moe, seed=3 + moe)
    inputs = after_x(family, op, seed=5 + moe)
    name = {"dsv41": ("dsv41_boundary", "dsv41_finalize"), "glm5": ("glm5_boundary", "glm5_boundary_moe")}
    args = (op.state, op.handle, *tensors, *inputs)
    torch.library.opcheck(mhc(name[family][moe]), args, test_utils=STANDALONE, **EQUAL)
    if family == "glm5":
        torch.ops.mhc.glm5_join(op.state, op.handle, inputs[0])  # the last call's side stream


# ------------------------------------------------------------- two-phase calls
def two_phase(family: str, op, moe: bool, seed: int) -> list[tuple[str, tuple]]:
    """The calls of one two-phase boundary, in order: publish, collect (GLM: then join)."""
    publish, tensors, like = publish_input(op, moe, seed)
    calls = [(publish, (op.state, op.handle, *tensors))]
    if family == "core":
        return [*calls, ("all_reduce_collect", (op.state, op.handle, like))]
    inputs = after_x(family, op, seed + 100)
    calls.append((f"{family}_collect", (op.state, op.handle, *inputs)))
    if family == "glm5":
        calls.append(("glm5_join", (op.state, op.handle, inputs[0])))
    return calls


def opcheck_in_order(calls: list[tuple[str, tuple]]) -> None:
    """Each sub-test over the whole sequence before the next (each of them calls an op once)."""
    for test in ONE_CALL_EACH:
        for name, args in calls:
            torch.library.opcheck(mhc(name), args, test_utils=test)


def in_order(calls: list[tuple[str, tuple]]) -> list:
    """The calls in order, on the op's own state (what a model passes)."""
    return [getattr(torch.ops.mhc, name)(*args) for name, args in calls]


def check_aot_dispatch(calls: list[tuple[str, tuple]], what: str, *, moves: bool) -> None:
    """``test_aot_dispatch_dynamic`` for a sequence: compiled through AOTAutograd (M symbolic), then
    the same calls eagerly; every output bitwise equal. A functionalized graph hands each op a copy
    of the state and writes it back afterwards: the ops copy their advanced state into it
    (``mhc_core.host.library.run``), so the compiled calls move the mailbox generation exactly as
    the eager ones (``moves``: by a nonzero step; a tp = 1 direct call moves nothing)."""
    state = calls[0][1][0]
    torch._dynamo.reset()
    compiled = torch.compile(in_order, backend="aot_eager", dynamic=True, fullgraph=True)
    start = int(state[NEXT_STAGE])
    actual = compiled(calls)
    middle = int(state[NEXT_STAGE])
    expected = in_order(calls)
    end = int(state[NEXT_STAGE])
    step = (end - middle) % 3
    assert (middle - start) % 3 == step, (
        f"{what}: the compiled calls moved the stage by {(middle - start) % 3}, eager by {step}"
    )
    assert bool(step) == moves, f"{what}: the stage moved by {step}"
    tensors = [pytree.tree_leaves(result) for result in (actual, expected)]
    assert len(tensors[0]) == len(tensors[1]), f"{what}: {len(tensors[0])} outputs, expected {len(tensors[1])}"
    for index, (a, e) in enumerate(zip(*tensors, strict=True)):
        if e is None:  # a publish
            assert a is None, f"{what}: output {index}"
        else:
            assert_bitwise_equal(a, e, f"{what}: output {index}")


@pytest.mark.parametrize("family", ["core", "dsv41", "glm5"])
@pytest.mark.parametrize("moe", [False, True], ids=["plain", "moe"])
def test_two_phase(ops, family: str, moe: bool) -> None:
    op = ops[family]
    opcheck_in_order(two_phase(family, op, moe, seed=10 + moe))
    calls = two_phase(family, op, moe, seed=20 + moe)
    check_aot_dispatch(calls, family, moves=True)


def test_glm5_join_after_boundary(ops) -> None:
    op = ops["glm5"]
    _, (x,), _ = publish_input(op, False, seed=30)
    inputs = after_x("glm5", op, seed=31)
    calls = [("glm5_boundary", (op.state, op.handle, x, *inputs)), ("glm5_join", (op.state, op.handle, inputs[0]))]
    opcheck_in_order(calls)
    check_aot_dispatch(calls, "glm5 boundary, join", moves=False)
