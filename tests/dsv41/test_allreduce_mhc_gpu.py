"""AllReduceMHC on the GPU against mhc_dsv41.reference: every H200 and GB300 preset shape, hc = 8,
hidden 7168 (three trips in rank-lane pairs), tp 1 and loopback 2, 4, 8, plain and MoE finalize, both post shapes,
poisoned out= buffers, -0 inputs, bitwise-identical ranks, CUDA-graph replays; the one-token collective
and the persistent one (forced at every M, few clusters)."""

from __future__ import annotations

import pytest
import torch

from tests.support import (
    all_reduce_ranks,
    assert_bitwise_equal,
    assert_within,
    bf16_randn,
    cached_ranks,
    poison,
    poisoned,
    run_ranks,
)
from tests.tolerances import dsv41_collapse_error, post_mix_tolerance, rms_norm_tolerance

pytestmark = pytest.mark.gpu

CAPACITY = 160
NORM_EPS = 1e-6


def preset_names() -> list[str]:
    from tests import presets  # shipped and test presets

    return [name for name in presets.names("dsv41") if name.startswith(("h200-", "gb300-", "test-"))]


def ops_for(name: str) -> list:
    from mhc_dsv41 import AllReduceMHC
    from tests import presets

    preset = presets.get("dsv41", name).PRESET
    return cached_ranks(
        ("dsv41", name, CAPACITY),
        preset.tp,
        lambda group: AllReduceMHC.from_config(preset, max_num_tokens=CAPACITY, device="cuda", group=group),
    )


#: Clusters of the persistent collective under test: few, so that every cluster loops over many
#: tokens (up to 23 at CAPACITY) and the staging buffers wrap around.
LOOPING_CLUSTERS = 7


def persistent_ops_for(name: str) -> list:
    """The preset's ops with the persistent collective at every M and ``LOOPING_CLUSTERS`` clusters."""
    from mhc_dsv41 import AllReduceMHC
    from tests import presets

    preset = presets.get("dsv41", name).PRESET
    return cached_ranks(
        ("dsv41-persistent", name, CAPACITY),
        preset.tp,
        lambda group: AllReduceMHC.from_config(
            preset, max_num_tokens=CAPACITY, device="cuda", group=group, persistent_min_tokens=1,
            clusters=LOOPING_CLUSTERS,
        ),
    )  # fmt: skip


def inputs(m: int, hc: int, hidden: int, generator: torch.Generator, *, post_3d: bool, negative_zero: bool):
    """Mixes in the ranges mHC produces (post in (0, 2), comb ~ doubly stochastic, pre in (0, 1))."""
    residual = bf16_randn(m, hc, hidden, generator=generator)
    if negative_zero:
        residual[0] = -0.0
    post = torch.rand(m, hc, generator=generator, device="cuda") * 2
    comb = torch.softmax(torch.randn(m, hc, hc, generator=generator, device="cuda"), dim=-1)
    pre = torch.rand(m, hc, generator=generator, device="cuda")
    weight = (torch.rand(hidden, generator=generator, device="cuda") + 0.5).to(torch.bfloat16)
    return residual, (post[..., None] if post_3d else post).contiguous(), comb, pre, weight


def check_outputs(results, reduced, residual, post, comb, pre, weight) -> None:
    from mhc_dsv41 import reference

    expected_residual, expected_input = reference.dsv41_boundary(reduced, residual, post, comb, pre, weight, NORM_EPS)
    residual_tolerance = post_mix_tolerance(reduced, residual, post, comb, expected_residual)
    collapse = (expected_residual.float() * pre.float()[..., None]).sum(1).to(torch.bfloat16)
    collapse_error = dsv41_collapse_error(expected_residual, residual_tolerance, pre, collapse)
    input_tolerance = rms_norm_tolerance(collapse, collapse_error, weight, NORM_EPS, expected_input)
    for rank, (residual_out, layer_input) in enumerate(results):
        assert_within(residual_out, expected_residual, residual_tolerance, f"rank {rank} residual_out")
        assert_within(layer_input, expected_input, input_tolerance, f"rank {rank} layer_input")
        assert_bitwise_equal(residual_out, results[0][0], f"rank {rank} residual_out vs rank 0")
        assert_bitwise_equal(layer_input, results[0][1], f"rank {rank} layer_input vs rank 0")


def run_case(ops, m: int, generator: torch.Generator, *, finalize: bool, post_3d: bool, negative_zero: bool) -> None:
    from mhc_core import MoEOutput, reference

    op = ops[0]
    tp, hc, hidden, top_k = op.tp, op.hc_mult, op.hidden_size, op.top_k
    residual, post, comb, pre, weight = inputs(m, hc, hidden, generator, post_3d=post_3d, negative_zero=negative_zero)
    outs = [(poisoned((m, hc, hidden), torch.bfloat16), poisoned((m, hidden), torch.bfloat16)) for _ in range(tp)]
    if finalize:
        moes = []
        for _ in range(tp):
            rows = 2 * m + 3
            index = torch.randint(0, rows, (m, top_k), generator=generator, device="cuda", dtype=torch.int32)
            index[torch.rand(m, top_k, generator=generator, device="cuda") < 0.3] = -1
            moes.append(
                MoEOutput(
                    bf16_randn(rows, hidden, generator=generator),
                    torch.rand(m, top_k, generator=generator, device="cuda") / top_k,
                    index,
                    bf16_randn(m, hidden, generator=generator),
                )
            )
        args = [
            (mo.gemm2_permuted, mo.expert_weights, mo.expanded_idx_to_permuted_idx, mo.shared_output,
             residual, post, comb, pre, weight, NORM_EPS)
            for mo in moes
        ]  # fmt: skip
        results = run_ranks(ops, "finalize", args, [dict(out=o) for o in outs])
        # The kernel's reduced x: the same finalize publish and the same rank-order FP32
        # sum run by LamportAllReduce (bit-identical; checked against the reference with
        # its own tolerance in tests/core/test_finalize_gpu.py).
        all_reduce = all_reduce_ranks(tp, hidden, capacity=CAPACITY, top_k=top_k)
        reduced = run_ranks(all_reduce, "call", [(mo,) for mo in moes])[0]
        check_outputs(results, reduced, residual, post, comb, pre, weight)
        return
    partials = [bf16_randn(m, hidden, generator=generator) for _ in range(tp)]
    if negative_zero:
        partials[0][-1] = -0.0
    results = run_ranks(
        ops, "call", [(p, residual, post, comb, pre, weight, NORM_EPS) for p in partials], [dict(out=o) for o in outs]
    )
    for result, out in zip(results, outs, strict=True):
        assert result[0].data_ptr() == out[0].data_ptr() and result[1].data_ptr() == out[1].data_ptr()
    check_outputs(results, reference.all_reduce(partials), residual, post, comb, pre, weight)


@pytest.mark.parametrize("name", preset_names())
def test_preset_shapes_against_reference(name: str) -> None:
    ops = ops_for(name)
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, name)))
    for index, m in enumerate((1, 3, 16, 128, CAPACITY)):
        run_case(ops, m, generator, finalize=False, post_3d=index % 2 == 1, negative_zero=index == 2)


@pytest.mark.parametrize("name", preset_names())
def test_persistent_collective_against_reference(name: str) -> None:
    """The persistent collective (every cluster looping over its tokens, inputs staged ahead):
    plain calls (the direct read at tp = 1) and the MoE finalize (the mailbox path)."""
    ops = persistent_ops_for(name)
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, name)) + 1)
    for index, m in enumerate((1, LOOPING_CLUSTERS + 1, 37, CAPACITY)):
        run_case(ops, m, generator, finalize=False, post_3d=index % 2 == 0, negative_zero=index == 1)
    run_case(ops, CAPACITY, generator, finalize=True, post_3d=False, negative_zero=False)


@pytest.mark.parametrize("name", ["h200-tp1-h5120", "h200-tp2-h5120", "h200-tp4-h5120", "h200-tp8-h5120"])
def test_finalize_against_reference(name: str) -> None:
    ops = ops_for(name)
    generator = torch.Generator("cuda").manual_seed(11)
    for m in (1, 16, CAPACITY):
        run_case(ops, m, generator, finalize=True, post_3d=False, negative_zero=False)


@pytest.mark.parametrize("m", (1, 37, CAPACITY))
def test_cuda_graph_replays(m: int) -> None:
    from mhc_core import reference

    ops = ops_for("h200-tp2-h5120")
    op = ops[0]
    hc, hidden = op.hc_mult, op.hidden_size
    generator = torch.Generator("cuda").manual_seed(m)
    partials = [torch.zeros(m, hidden, dtype=torch.bfloat16, device="cuda") for _ in ops]
    residual, post, comb, pre, weight = inputs(m, hc, hidden, generator, post_3d=False, negative_zero=False)
    outs = [(poisoned((m, hc, hidden), torch.bfloat16), poisoned((m, hidden), torch.bfloat16)) for _ in ops]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_ranks(
            ops,
            "call",
            [(p, residual, post, comb, pre, weight, NORM_EPS) for p in partials],
            [dict(out=o) for o in outs],
        )
    for _ in range(200):
        for partial in partials:
            partial.copy_(bf16_randn(m, hidden, generator=generator))
        fresh = inputs(m, hc, hidden, generator, post_3d=False, negative_zero=False)
        for static, value in zip((residual, post, comb, pre, weight), fresh, strict=True):
            static.copy_(value)
        for pair in outs:
            for tensor in pair:
                poison(tensor)
        graph.replay()
        check_outputs(outs, reference.all_reduce(partials), residual, post, comb, pre, weight)


def test_two_phase_form_matches_call() -> None:
    ops = ops_for("h200-tp1-h5120")
    op = ops[0]
    generator = torch.Generator("cuda").manual_seed(2)
    x = bf16_randn(5, op.hidden_size, generator=generator)
    residual, post, comb, pre, weight = inputs(
        5, op.hc_mult, op.hidden_size, generator, post_3d=False, negative_zero=False
    )
    called = op(x, residual, post, comb, pre, weight, NORM_EPS)
    op.publish(x)
    collected = op.collect(residual, post, comb, pre, weight, NORM_EPS)
    op.publish(x)
    collected_pdl = op.collect(residual, post, comb, pre, weight, NORM_EPS, after_publish=True)
    for result in (collected, collected_pdl):
        assert_bitwise_equal(result[0], called[0], "residual_out")
        assert_bitwise_equal(result[1], called[1], "layer_input")


def test_plain_constructor_geometry_and_repr() -> None:
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41.config import default_geometry

    assert default_geometry(5120, 4, 4) == {"cluster_size": 5, "threads": 128, "rank_lanes": 1}
    op = AllReduceMHC(hidden_size=5120, hc_mult=4, max_num_tokens=8, top_k=8, device="cuda")
    assert (op.config.cluster_size, op.config.threads, op.config.rank_lanes) == (5, 128, 1)
    assert "cluster_size=5" in repr(op) and "transport='local'" in repr(op)


def test_construction_reports_its_phases() -> None:
    """What a cold op spends its construction on, per phase (logged, and kept for the prebuilt
    test's report): every phase measured, the warm-up on the group's last rank."""
    ops = ops_for("h200-tp2-h5120")
    for op in ops:
        assert list(op.construction_seconds) == ["kernels", "mailbox", "programs", "warm_up"]
        assert all(seconds >= 0 for seconds in op.construction_seconds.values())
