"""Interleaved CUDA graphs and eager calls on one op: three graphs of different M captured
between eager calls, then twelve steps in a random order, each a replay (fresh inputs copied
into the graph's static tensors, outputs poisoned) or an eager call of another M, joined or not
(GLM and DSV, tp 1 and loopback tp 4). Every step's outputs within the reference's tolerances,
every rank bitwise identical."""

from __future__ import annotations

import random

import pytest
import torch

from tests.lifecycle.common import DSV, GLM, dsv_ops, glm_ops, poison_all

pytestmark = pytest.mark.gpu

CAPACITY = 64
GRAPH_MS = (1, 20, 40)  # one-token, x2 and x4 / x8 kernels at the GLM presets' thresholds
EAGER_MS = (5, 33, 64)
CASES = (
    ("glm5", "h200-tp1-h4096"),
    ("glm5", "h200-tp4-h4096"),
    ("dsv41", "h200-tp1-h5120"),
    ("dsv41", "h200-tp4-h5120"),
)


def eager_step(model, ops, m: int, generator: torch.Generator, *, join: bool) -> None:
    case = model.case(ops, m, generator, negative_zero=m == EAGER_MS[0])
    # An un-joined GLM call leaves its side kernel pending into whatever comes next.
    results = model.call(ops, case, model.outputs(ops, m), join=join)
    model.check(ops, results, case)


@pytest.mark.parametrize(("family", "name"), CASES)
def test_graphs_and_eager_calls_interleaved(family: str, name: str) -> None:
    model, ops = (GLM, glm_ops(name, CAPACITY)) if family == "glm5" else (DSV, dsv_ops(name, CAPACITY))
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, name)))
    graphs = []
    for index, m in enumerate(GRAPH_MS):
        case, outs = model.case(ops, m, generator), model.outputs(ops, m)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.call(ops, case, outs)
        graphs.append((graph, case, outs))
        # Capture right after construction, then after eager calls joined and not.
        eager_step(model, ops, EAGER_MS[index], generator, join=index % 2 == 0)
    steps = [("graph", k) for k in range(len(GRAPH_MS))] * 2 + [("eager", m) for m in EAGER_MS] * 2
    random.Random(name).shuffle(steps)
    for step, (kind, which) in enumerate(steps):
        if kind == "eager":
            eager_step(model, ops, which, generator, join=step % 2 == 0)
            continue
        graph, case, outs = graphs[which]
        model.refill(case, ops, generator)
        poison_all(outs)
        graph.replay()
        model.check(ops, outs, case)
