"""Several boundaries in a row at loopback tp 2 inside one ``torch.compile(fullgraph=True)`` function,
both models: loopback ranks share one stream, so each call goes through the two-phase ops (every rank
publishes, then every rank collects; GLM: each rank joins after its collect), each call fed the one
before's outputs on every rank, as layers are. Every call's every output on every rank equals the same
calls made eagerly (``run_ranks``), bitwise."""

from __future__ import annotations

import pytest
import torch

from tests.lifecycle.common import DSV, GLM, dsv_ops, glm_ops
from tests.support import assert_bitwise_equal, run_ranks

pytestmark = pytest.mark.gpu

CAPACITY = 32
M = 6
CALLS = 3
NORM_EPS = 1e-6


# ---------------------------------------------------------------------- DSV4.1
def compiled_dsv(ops, partials, residual, post, comb, pre, weight):
    from mhc_core.host import library as core
    from mhc_dsv41 import library

    xs, residuals, outputs = list(partials), [residual] * len(ops), []
    for _ in range(CALLS):
        for op, x in zip(ops, xs, strict=True):
            core.publish_input(op, x)
        results = [
            library.collect(op, r, post, comb, pre, weight, NORM_EPS) for op, r in zip(ops, residuals, strict=True)
        ]
        residuals, xs = [r for r, _ in results], [x for _, x in results]
        outputs.append(results)
    return outputs


def eager_dsv(ops, partials, residual, post, comb, pre, weight):
    xs, residuals, outputs = list(partials), [residual] * len(ops), []
    for _ in range(CALLS):
        args = [(x, r, post, comb, pre, weight, NORM_EPS) for x, r in zip(xs, residuals, strict=True)]
        results = run_ranks(ops, "call", args)
        residuals, xs = [r for r, _ in results], [x for _, x in results]
        outputs.append(results)
    return outputs


# ----------------------------------------------------------------------- GLM-5.3
def compiled_glm(ops, partials, residual, post, comb, fn, scale, base, weight):
    from mhc_core.host import library as core
    from mhc_glm5 import library

    carried = [(x, residual, post, comb) for x in partials]  # per rank: x, residual, post, comb
    outputs = []
    for _ in range(CALLS):
        for op, rank in zip(ops, carried, strict=True):
            core.publish_input(op, rank[0])
        results = []
        for op, (_, r, p, c) in zip(ops, carried, strict=True):
            r, x = library.collect(op, r, p, c, fn, scale, base, weight)
            results.append((r, *library.join(op, r), x))
        carried = [(x, r, p, c) for r, p, c, x in results]
        outputs.append(results)
    return outputs


def eager_glm(ops, partials, residual, post, comb, fn, scale, base, weight):
    carried = [(x, residual, post, comb) for x in partials]
    outputs = []
    for _ in range(CALLS):
        results = run_ranks(ops, "call", [(*rank, fn, scale, base, weight) for rank in carried])
        for op in ops:
            op.join()
        carried = [(x, r, p, c) for r, p, c, x in results]
        outputs.append(results)
    return outputs


# ------------------------------------------------------------------------ test
MODELS = {
    "dsv41": ("h200-tp2-h5120", dsv_ops, DSV, compiled_dsv, eager_dsv),
    "glm5": ("h200-tp2-h4096", glm_ops, GLM, compiled_glm, eager_glm),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_calls_in_a_row_equal_eager_bitwise(model: str) -> None:
    name, build, family, compiled_calls, eager_calls = MODELS[model]
    ops = build(name, CAPACITY)
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, model)))
    case = family.case(ops, M, generator, negative_zero=True)
    shared = tuple(case.shared.values()) if isinstance(case.shared, dict) else tuple(case.shared)

    torch._dynamo.reset()
    compiled = torch.compile(lambda partials, *shared: compiled_calls(ops, partials, *shared), fullgraph=True)
    actual = compiled(case.partials, *shared)
    expected = eager_calls(ops, case.partials, *shared)
    torch.cuda.synchronize()
    assert len(actual) == len(expected) == CALLS
    for call, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
        for rank, (a_outputs, e_outputs) in enumerate(zip(mine, theirs, strict=True)):
            for k, (a, e) in enumerate(zip(a_outputs, e_outputs, strict=True)):
                assert_bitwise_equal(a, e, f"{name}: call {call}, rank {rank}, output {k}")


def shared_of(case) -> tuple:
    return tuple(case.shared.values()) if isinstance(case.shared, dict) else tuple(case.shared)


def assert_calls_equal(actual: list, expected: list, what: str) -> None:
    for call, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
        for rank, (a_outputs, e_outputs) in enumerate(zip(mine, theirs, strict=True)):
            for k, (a, e) in enumerate(zip(a_outputs, e_outputs, strict=True)):
                assert_bitwise_equal(a, e, f"{what}: call {call}, rank {rank}, output {k}")


def cloned(calls: list) -> list:
    """A graph's outputs copied out before the next replay overwrites them."""
    return [[tuple(t.clone() for t in outputs) for outputs in call] for call in calls]


@pytest.mark.parametrize("model", list(MODELS))
def test_reduce_overhead_runs_as_a_cuda_graph(model: str) -> None:
    """The same chain at loopback tp 2 under ``mode="reduce-overhead"``: no CUDA-graph skip, and every
    run (warm-up, recording, replays) equal to eager bitwise."""
    from torch._dynamo.utils import counters

    name, build, family, compiled_calls, eager_calls = MODELS[model]
    ops = build(name, CAPACITY)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(
        lambda partials, *shared: compiled_calls(ops, partials, *shared), fullgraph=True, mode="reduce-overhead"
    )
    for seed in range(4):
        case = family.case(ops, M, torch.Generator("cuda").manual_seed(40 + seed), negative_zero=True)
        actual = cloned(compiled(case.partials, *shared_of(case)))
        expected = eager_calls(ops, case.partials, *shared_of(case))
        torch.cuda.synchronize()
        assert_calls_equal(actual, expected, f"{name} reduce-overhead run {seed}")
    skips = dict(counters["inductor"])
    assert not any(key.startswith("cudagraph_skips") and value for key, value in skips.items()), skips


@pytest.mark.parametrize("model", list(MODELS))
def test_manual_capture_of_the_compiled_function(model: str) -> None:
    """The compiled chain at loopback tp 2 captured by hand, replayed on fresh data copied into its
    inputs, equal to eager on the same inputs, bitwise."""
    name, build, family, compiled_calls, eager_calls = MODELS[model]
    ops = build(name, CAPACITY)
    static = family.case(ops, M, torch.Generator("cuda").manual_seed(50), negative_zero=True)
    static_shared = shared_of(static)
    torch._dynamo.reset()
    compiled = torch.compile(lambda partials, *shared: compiled_calls(ops, partials, *shared), fullgraph=True)
    compiled(static.partials, *static_shared)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(static.partials, *static_shared)
    for seed in range(3):
        fresh = family.case(ops, M, torch.Generator("cuda").manual_seed(60 + seed), negative_zero=True)
        for tensor, value in zip([*static.partials, *static_shared], [*fresh.partials, *shared_of(fresh)], strict=True):
            tensor.copy_(value)
        graph.replay()
        actual = cloned(captured)
        expected = eager_calls(ops, static.partials, *static_shared)
        torch.cuda.synchronize()
        assert_calls_equal(actual, expected, f"{name} replay {seed}")
