"""CUDA-graph capture of AllReduceMhcBoundary in the orders users meet (tp 1 and loopback tp 2):
capture right after construction; capture after an eager call left un-joined; capture after
torch's side-stream warm-up recipe. Each replay (fresh inputs in the graph's static tensors,
poisoned outputs) must match the reference, and bitwise an eager call with the same inputs on the
same op. AllReduceMHC captured right after construction guards the DSV op."""

from __future__ import annotations

import pytest
import torch

from tests.lifecycle.common import DSV, GLM, assert_results_equal, dsv_ops, glm_ops, poison_all

pytestmark = pytest.mark.gpu

CAPACITY = 32
REPLAYS = 3
GLM_NAMES = ("h200-tp1-h4096", "h200-tp2-h4096")
M_VALUES = (1, 20)  # the one-token kernel and a grouped one


def capture(model, ops, case, outs) -> torch.cuda.CUDAGraph:
    """The user's captured region: every rank's call, then (GLM) each op's join() before the end."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.call(ops, case, outs)
    return graph


def replay_and_compare(model, ops, graph, case, outs, generator) -> None:
    for replay in range(REPLAYS):
        model.refill(case, ops, generator)
        poison_all(outs)
        graph.replay()
        model.check(ops, outs, case)
        # The same inputs eagerly, on the same op, after the replay: eager calls and replays interleave.
        eager = model.call(ops, case, model.outputs(ops, case.m))
        torch.cuda.synchronize()
        assert_results_equal(model, outs, eager, f"replay {replay} vs eager")


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("name", GLM_NAMES)
def test_capture_right_after_construction(name: str, m: int) -> None:
    # Fresh ops: construction's warm-up is the last thing they ran.
    ops = glm_ops(name, CAPACITY)
    generator = torch.Generator("cuda").manual_seed(100 + m)
    case, outs = GLM.case(ops, m, generator), GLM.outputs(ops, m)
    graph = capture(GLM, ops, case, outs)
    replay_and_compare(GLM, ops, graph, case, outs, generator)


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("name", GLM_NAMES)
def test_capture_after_an_unjoined_eager_call(name: str, m: int) -> None:
    ops = glm_ops(name, CAPACITY)
    generator = torch.Generator("cuda").manual_seed(200 + m)
    eager_case = GLM.case(ops, m, generator, negative_zero=True)
    eager = GLM.call(ops, eager_case, GLM.outputs(ops, m), join=False)
    # Its results are complete once the device is idle; the ops still hold the un-joined call.
    GLM.check(ops, eager, eager_case)
    case, outs = GLM.case(ops, m, generator), GLM.outputs(ops, m)
    graph = capture(GLM, ops, case, outs)
    replay_and_compare(GLM, ops, graph, case, outs, generator)


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("name", GLM_NAMES)
def test_capture_after_torch_side_stream_warmup(name: str, m: int) -> None:
    """torch's recipe: warm up on a side stream, rejoin, then capture the same body."""
    ops = glm_ops(name, CAPACITY)
    generator = torch.Generator("cuda").manual_seed(300 + m)
    case, outs = GLM.case(ops, m, generator), GLM.outputs(ops, m)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            GLM.call(ops, case, outs)  # the body the graph will hold: every call, then the joins
    torch.cuda.current_stream().wait_stream(side)
    GLM.check(ops, outs, case)
    graph = capture(GLM, ops, case, outs)
    replay_and_compare(GLM, ops, graph, case, outs, generator)


def test_dsv_capture_right_after_construction() -> None:
    """A guard: the DSV op has no side stream and captures from its first call on."""
    ops = dsv_ops("h200-tp1-h5120", CAPACITY)
    generator = torch.Generator("cuda").manual_seed(400)
    case, outs = DSV.case(ops, 7, generator), DSV.outputs(ops, 7)
    graph = capture(DSV, ops, case, outs)
    replay_and_compare(DSV, ops, graph, case, outs, generator)
