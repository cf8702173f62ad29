"""The ``torch.ops.mhc`` custom ops trace under ``torch.compile(fullgraph=True)`` on fake CUDA
tensors, on a machine without a GPU: no graph break, every call kept in order (each mutates the
op's state), the fake implementations' shapes and dtypes, and GLM's join placed before any use
of the side-stream outputs (they come only from it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mhc_core import registry

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, HC, MIX, TOP_K, M = 64, 4, 24, 2, 5
BF16, F32 = torch.bfloat16, torch.float32


def traced(function, *args, dynamic: bool | None = None):
    """Compile ``function`` with fullgraph=True through a backend that keeps Dynamo's FX graph,
    run it on ``args`` (fake CUDA tensors), return (outputs, the graph's custom-op calls in order)."""
    import mhc_dsv41.library  # noqa: F401  (registers the ops; no GPU, no DSL)
    import mhc_glm5.library  # noqa: F401

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    outputs = torch.compile(function, fullgraph=True, backend=backend, dynamic=dynamic)(*args)
    assert len(graphs) == 1, f"expected one graph (no break), got {len(graphs)}"
    calls = [
        str(node.target).removeprefix("mhc.").split(".")[0]
        for node in graphs[0].graph.nodes
        if node.op == "call_function" and str(node.target).startswith("mhc.")
    ]
    return outputs, calls


def tensors(mode: FakeTensorMode, *specs):
    with mode:
        return [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in specs]


def test_the_library_modules_need_no_dsl() -> None:
    """Registering the ops imports torch only: a fresh interpreter never loads the DSL for it."""
    code = (
        "import sys, torch, mhc_core.host.library, mhc_dsv41.library, mhc_glm5.library; "
        "names = torch._C._dispatch_get_all_op_names(); "
        "print(sorted(n.removeprefix('mhc::') for n in names if n.startswith('mhc::'))); "
        "print('cutlass' in sys.modules)"
    )
    sources = [str(ROOT / "packages" / p / "src") for p in ("mhc-core", *registry.distributions())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sources)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    names, dsl = result.stdout.strip().splitlines()
    assert dsl == "False", "registering the custom ops imported the DSL"
    expected = {
        "all_reduce", "all_reduce_moe", "publish", "publish_moe", "all_reduce_collect",
        "dsv41_boundary", "dsv41_finalize", "dsv41_collect",
        "glm5_boundary", "glm5_boundary_moe", "glm5_collect", "glm5_join",
    }  # fmt: skip
    assert expected <= set(ast.literal_eval(names)), expected - set(ast.literal_eval(names))


def test_all_reduce_calls_keep_their_order() -> None:
    mode = FakeTensorMode()
    state, x = tensors(mode, ((4,), torch.int32), ((M, HIDDEN), BF16))

    def step(state, x):
        y = torch.ops.mhc.all_reduce(state, 1, x)
        z = torch.ops.mhc.all_reduce(state, 1, y * 2)
        torch.ops.mhc.publish(state, 1, z)
        return torch.ops.mhc.all_reduce_collect(state, 1, z)

    with mode:
        out, calls = traced(step, state, x)
    assert calls == ["all_reduce", "all_reduce", "publish", "all_reduce_collect"]
    assert out.shape == (M, HIDDEN) and out.dtype == BF16 and out.device.type == "cuda"


def test_moe_inputs() -> None:
    mode = FakeTensorMode()
    state, gemm2, weights, index, shared = tensors(
        mode, ((4,), torch.int32), ((2 * M, HIDDEN), BF16), ((M, TOP_K), F32), ((M, TOP_K), torch.int32),
        ((M, HIDDEN), BF16),
    )  # fmt: skip

    def step(state, gemm2, weights, index, shared):
        torch.ops.mhc.publish_moe(state, 2, gemm2, weights, index, shared)
        first = torch.ops.mhc.all_reduce_collect(state, 2, shared)
        return first + torch.ops.mhc.all_reduce_moe(state, 2, gemm2, weights, index, shared)

    with mode:
        out, calls = traced(step, state, gemm2, weights, index, shared)
    assert calls == ["publish_moe", "all_reduce_collect", "all_reduce_moe"]
    assert out.shape == (M, HIDDEN)


def test_dsv41_boundaries_chain() -> None:
    mode = FakeTensorMode()
    state, x, residual, post, comb, pre, weight, gemm2, weights, index = tensors(
        mode, ((4,), torch.int32), ((M, HIDDEN), BF16), ((M, HC, HIDDEN), BF16), ((M, HC), F32), ((M, HC, HC), F32),
        ((M, HC), F32), ((HIDDEN,), BF16), ((2 * M, HIDDEN), BF16), ((M, TOP_K), F32), ((M, TOP_K), torch.int32),
    )  # fmt: skip

    def layer(state, x, residual, post, comb, pre, weight, gemm2, weights, index):
        streams, hidden = torch.ops.mhc.dsv41_boundary(state, 3, x, residual, post, comb, pre, weight, 1e-6)
        streams, hidden = torch.ops.mhc.dsv41_finalize(
            state, 3, gemm2, weights, index, hidden, streams, post, comb, pre, weight, 1e-6
        )
        torch.ops.mhc.publish(state, 3, hidden)
        return torch.ops.mhc.dsv41_collect(state, 3, streams, post, comb, pre, weight, 1e-6)

    with mode:
        (streams, hidden), calls = traced(layer, state, x, residual, post, comb, pre, weight, gemm2, weights, index)
    assert calls == ["dsv41_boundary", "dsv41_finalize", "publish", "dsv41_collect"]
    assert streams.shape == (M, HC, HIDDEN) and streams.dtype == BF16
    assert hidden.shape == (M, HIDDEN) and hidden.dtype == BF16


def test_glm5_join_comes_before_the_side_outputs_are_used() -> None:
    mode = FakeTensorMode()
    state, x, residual, post, comb, fn, scale, base, weight = tensors(
        mode, ((4,), torch.int32), ((M, HIDDEN), BF16), ((M, HC, HIDDEN), BF16), ((M, HC, 1), F32),
        ((M, HC, HC), F32), ((MIX, HC * HIDDEN), BF16), ((3,), F32), ((MIX,), F32), ((HIDDEN,), BF16),
    )  # fmt: skip

    def two_layers(state, x, residual, post, comb, fn, scale, base, weight):
        streams, hidden = torch.ops.mhc.glm5_boundary(state, 4, x, residual, post, comb, fn, scale, base, weight)
        sublayer = hidden * 3  # the next sublayer runs while the side stream finishes the mixes
        post, comb = torch.ops.mhc.glm5_join(state, 4, streams)
        streams, hidden = torch.ops.mhc.glm5_boundary(state, 4, sublayer, streams, post, comb, fn, scale, base, weight)
        return streams, hidden, torch.ops.mhc.glm5_join(state, 4, streams)

    with mode:
        (streams, hidden, (post, comb)), calls = traced(two_layers, state, x, residual, post, comb, fn, scale, base,
                                                         weight)  # fmt: skip
    assert calls == ["glm5_boundary", "glm5_join", "glm5_boundary", "glm5_join"]
    assert post.shape == (M, HC, 1) and post.dtype == F32
    assert comb.shape == (M, HC, HC) and comb.dtype == F32
    assert streams.shape == (M, HC, HIDDEN) and hidden.shape == (M, HIDDEN)


def test_no_mutating_op_returns_a_list() -> None:
    """Functionalization (torch.compile's AOT dispatch, opcheck) refuses a mutating custom op whose
    return is ``Tensor[]`` ("output has alias annotations"; seen on the H200 for the FP8 ops, which
    returned a list): every ``mhc`` op that writes its state returns a fixed tuple."""
    import mhc_dsv41.library  # noqa: F401
    import mhc_glm5.library  # noqa: F401

    names = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("mhc::")]
    assert len(names) >= 15, names
    for name in names:
        schema = torch._C._get_schema(name, "")
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        lists = [str(r.type) for r in schema.returns if isinstance(r.type, torch.ListType)]
        assert not (mutates and lists), f"{name} mutates an argument and returns {lists}: {schema}"
