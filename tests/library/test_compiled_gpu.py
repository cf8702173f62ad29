"""The ``torch.ops.mhc`` custom ops inside compiled functions on the GPU: equal to eager bitwise
(tp 1 and loopback tp 2, both models), under ``mode="reduce-overhead"`` (which must really run as a
CUDA graph) and under a manual capture of the compiled function, and several calls in a row keep
every call, in order (each call's outputs checked)."""

from __future__ import annotations

import pytest
import torch

from tests.lifecycle.common import DSV, GLM, dsv_ops, glm_ops
from tests.support import assert_bitwise_equal

pytestmark = pytest.mark.gpu

CAPACITY = 32
NORM_EPS = 1e-6


def dsv_chain(op, x, residual, post, comb, pre, weight, calls: int):
    """``calls`` DSV boundaries, each fed the last one's outputs (as layers do)."""
    from mhc_dsv41 import library

    outputs = []
    for _ in range(calls):
        residual, x = library.boundary(op, x, residual, post, comb, pre, weight, NORM_EPS)
        outputs.append((residual, x))
    return outputs


def glm_chain(op, x, residual, post, comb, fn, scale, base, weight, calls: int):
    """``calls`` GLM boundaries chained through their four outputs, each joined by the join op."""
    from mhc_glm5 import library

    outputs = []
    for _ in range(calls):
        residual, x = library.boundary(op, x, residual, post, comb, fn, scale, base, weight)
        post, comb = library.join(op, residual)
        outputs.append((residual, post, comb, x))
    return outputs


def eager_dsv(op, x, residual, post, comb, pre, weight, calls):
    outputs = []
    for _ in range(calls):
        residual, x = op(x, residual, post, comb, pre, weight, NORM_EPS)
        outputs.append((residual, x))
    return outputs


def eager_glm(op, x, residual, post, comb, fn, scale, base, weight, calls):
    outputs = []
    for _ in range(calls):
        residual, post, comb, x = op(x, residual, post, comb, fn, scale, base, weight)
        op.join()
        outputs.append((residual, post, comb, x))
    return outputs


def inputs(model, op, m: int, seed: int) -> tuple:
    generator = torch.Generator("cuda").manual_seed(seed)
    case = model.case([op], m, generator, negative_zero=True)
    shared = tuple(case.shared.values()) if isinstance(case.shared, dict) else tuple(case.shared)
    return (case.partials[0], *shared)


def assert_same(actual: list, expected: list, what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} calls, expected {len(expected)}"
    for index, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
        for k, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_bitwise_equal(a, b, f"{what}: call {index}, output {k}")


CASES = [("dsv41", "h200-tp1-h5120"), ("glm5", "h200-tp1-h4096")]


def build(model: str, name: str):
    return (dsv_ops if model == "dsv41" else glm_ops)(name, CAPACITY)[0]


def chain(model: str):
    return (dsv_chain, eager_dsv) if model == "dsv41" else (glm_chain, eager_glm)


@pytest.mark.parametrize(("model", "name"), CASES)
def test_compiled_equals_eager_bitwise(model: str, name: str) -> None:
    op = build(model, name)
    compiled_chain, eager_chain = chain(model)
    args = inputs(DSV if model == "dsv41" else GLM, op, 7, 1)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_chain, fullgraph=True)
    actual = compiled(op, *args, calls=3)
    expected = eager_chain(op, *args, calls=3)
    torch.cuda.synchronize()
    assert_same(actual, expected, f"{name} compiled")


@pytest.mark.parametrize(("model", "name"), CASES)
def test_reduce_overhead_runs_as_a_cuda_graph(model: str, name: str) -> None:
    from torch._dynamo.utils import counters

    op = build(model, name)
    compiled_chain, eager_chain = chain(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_chain, fullgraph=True, mode="reduce-overhead")
    for seed in range(4):  # warm-up runs, the recording, then replays
        args = inputs(DSV if model == "dsv41" else GLM, op, 9, 10 + seed)
        actual = [tuple(t.clone() for t in call) for call in compiled(op, *args, calls=2)]
        expected = eager_chain(op, *args, calls=2)
        torch.cuda.synchronize()
        assert_same(actual, expected, f"{name} reduce-overhead run {seed}")
    skips = dict(counters["inductor"])
    assert not any(key.startswith("cudagraph_skips") and value for key, value in skips.items()), skips


@pytest.mark.parametrize(("model", "name"), CASES)
def test_manual_capture_of_the_compiled_function(model: str, name: str) -> None:
    op = build(model, name)
    compiled_chain, eager_chain = chain(model)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_chain, fullgraph=True)
    static = inputs(DSV if model == "dsv41" else GLM, op, 5, 20)
    compiled(op, *static, calls=2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = compiled(op, *static, calls=2)
    for seed in range(3):
        fresh = inputs(DSV if model == "dsv41" else GLM, op, 5, 30 + seed)
        for tensor, value in zip(static, fresh, strict=True):
            tensor.copy_(value)
        graph.replay()
        actual = [tuple(t.clone() for t in call) for call in captured]
        expected = eager_chain(op, *static, calls=2)
        torch.cuda.synchronize()
        assert_same(actual, expected, f"{name} replay {seed}")


@pytest.mark.parametrize("model", ["dsv41", "glm5"])
def test_loopback_tp2_two_phase_compiled(model: str) -> None:
    """Loopback ranks share one stream: every rank publishes before any collects (the two-phase ops)."""
    from mhc_core.host import library as core_library
    from tests.support import run_ranks

    name = "h200-tp2-h5120" if model == "dsv41" else "h200-tp2-h4096"
    ops = (dsv_ops if model == "dsv41" else glm_ops)(name, CAPACITY)
    family = DSV if model == "dsv41" else GLM
    generator = torch.Generator("cuda").manual_seed(40)
    case = family.case(ops, 6, generator, negative_zero=True)
    shared = tuple(case.shared.values()) if isinstance(case.shared, dict) else tuple(case.shared)

    def step(partials, shared):
        for op, x in zip(ops, partials, strict=True):
            core_library.publish_input(op, x)
        if model == "dsv41":
            from mhc_dsv41 import library

            return [library.collect(op, *shared, NORM_EPS) for op in ops]
        from mhc_glm5 import library

        results = []
        for op in ops:
            residual, x = library.collect(op, *shared)
            results.append((residual, *library.join(op, residual), x))
        return results

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    actual = compiled(case.partials, shared)
    expected = run_ranks(ops, "call", [family.rank_args(case, r) for r in range(2)])
    if model == "glm5":
        for op in ops:
            op.join()
        expected = [(e[0], e[1], e[2], e[3]) for e in expected]
    torch.cuda.synchronize()
    assert_same(actual, expected, f"{name} loopback compiled")
