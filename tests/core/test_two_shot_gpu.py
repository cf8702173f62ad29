"""The two-shot all-reduce protocol (issue #47) on the GPU, loopback tp 2, 4 and 8, both models.

What is exact, and checked bit for bit (fresh random data per case, poisoned outputs, -0 inputs):
- every rank's outputs are the same bits;
- they are the tp = 1 op's outputs (same geometry) fed with the all-reduced row
  ``bf16(tp_sum(partials))``: the two-shot rounds the reduced row to BF16 where the one-shot feeds
  the FP32 sum on (``mhc_core.device.two_shot``), and the tp = 1 op is checked against the models'
  references with derived tolerances in their own tests;
- an "auto" op serves M below its crossover bit-identically to a one-shot op and M from it to a
  two-shot op (the executor's routing), eager and from CUDA graphs replayed between eager calls.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import all_reduce_ranks, assert_bitwise_equal, bf16_randn, cached_ranks, poisoned, run_ranks

pytestmark = pytest.mark.gpu

CAPACITY = 96
NORM_EPS = 1e-6
DSV_HIDDEN = 5120
GLM_HIDDEN = 4096
#: Calls from this many tokens take the persistent kernels, so both routes of each protocol run.
PERSISTENT_FROM = 48
#: The crossover of the "auto" ops under test.
CROSSOVER = 8
MS = (1, 7, 33, PERSISTENT_FROM + 5, CAPACITY)


def dsv_ops(tp: int, protocol: str, **options) -> list:
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41.config import default_geometry

    geometry = default_geometry(DSV_HIDDEN, 4, tp)  # the tp op's geometry, one rank lane (or as given)
    geometry.update({key: options.pop(key) for key in list(options) if key in geometry})
    key = ("two-shot-dsv", tp, protocol, tuple(sorted(options.items())), tuple(sorted(geometry.items())))
    return cached_ranks(
        key,
        tp,
        lambda group: AllReduceMHC(
            hidden_size=DSV_HIDDEN, hc_mult=4, max_num_tokens=CAPACITY, top_k=8, device="cuda", group=group,
            cluster_size=geometry["cluster_size"], threads=geometry["threads"], rank_lanes=1,
            persistent_min_tokens=PERSISTENT_FROM, protocol=protocol, **options,
        ),
    )  # fmt: skip


def dsv_inputs(m: int, generator: torch.Generator):
    residual = bf16_randn(m, 4, DSV_HIDDEN, generator=generator)
    residual[0, 0, :8] = -0.0
    post = torch.rand(m, 4, generator=generator, device="cuda") * 2
    comb = torch.softmax(torch.randn(m, 4, 4, generator=generator, device="cuda"), dim=-1)
    pre = torch.rand(m, 4, generator=generator, device="cuda")
    weight = (torch.rand(DSV_HIDDEN, generator=generator, device="cuda") + 0.5).to(torch.bfloat16)
    return residual, post, comb, pre, weight


def partials_for(tp: int, m: int, hidden: int, generator: torch.Generator) -> list[torch.Tensor]:
    partials = [bf16_randn(m, hidden, generator=generator) for _ in range(tp)]
    partials[0][-1, :16] = -0.0
    partials[-1][0, 8:24] = -0.0
    return partials


def check_ranks(results, what: str) -> None:
    for rank, result in enumerate(results):
        for index, (tensor, first) in enumerate(zip(result, results[0], strict=True)):
            assert_bitwise_equal(tensor, first, f"{what}: rank {rank} output {index} vs rank 0")


def check_against(results, expected, what: str) -> None:
    for index, (tensor, reference) in enumerate(zip(results[0], expected, strict=True)):
        if tensor.element_size() == 1:  # FP8 values and UE8M0 scales: compared as bytes
            tensor, reference = tensor.view(torch.uint8), reference.view(torch.uint8)
        assert_bitwise_equal(tensor, reference, f"{what}: output {index} vs the tp = 1 op on the reduced row")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_dsv_two_shot_is_the_tp1_op_on_the_reduced_row(tp: int) -> None:
    from mhc_core import reference

    ops = dsv_ops(tp, "two-shot")
    assert ops[0].protocols.two_shot_from == 1 and "two-shot" in repr(ops[0])
    (solo,) = dsv_ops(1, "auto", cluster_size=ops[0].config.cluster_size, threads=ops[0].config.threads)
    generator = torch.Generator(device="cuda").manual_seed(4700 + tp)
    for m in MS:
        residual, post, comb, pre, weight = dsv_inputs(m, generator)
        partials = partials_for(tp, m, DSV_HIDDEN, generator)
        outs = [(poisoned((m, 4, DSV_HIDDEN), torch.bfloat16), poisoned((m, DSV_HIDDEN), torch.bfloat16)) for _ in ops]
        results = run_ranks(
            ops,
            "call",
            [(p, residual, post, comb, pre, weight, NORM_EPS) for p in partials],
            [dict(out=o) for o in outs],
        )
        check_ranks(results, f"tp {tp} M {m}")
        expected = solo(reference.all_reduce(partials), residual, post, comb, pre, weight, NORM_EPS)
        check_against(results, expected, f"tp {tp} M {m}")


@pytest.mark.parametrize("tp", [2, 8])
def test_dsv_two_shot_moe_finalize(tp: int) -> None:
    from mhc_core import MoEOutput

    ops = dsv_ops(tp, "two-shot")
    (solo,) = dsv_ops(1, "auto", cluster_size=ops[0].config.cluster_size, threads=ops[0].config.threads)
    generator = torch.Generator(device="cuda").manual_seed(4710 + tp)
    for m in (1, 29, CAPACITY):
        residual, post, comb, pre, weight = dsv_inputs(m, generator)
        moes = []
        for _ in range(tp):
            rows = 2 * m + 3
            index = torch.randint(0, rows, (m, 8), generator=generator, device="cuda", dtype=torch.int32)
            index[torch.rand(m, 8, generator=generator, device="cuda") < 0.3] = -1
            moes.append(
                MoEOutput(
                    bf16_randn(rows, DSV_HIDDEN, generator=generator),
                    torch.rand(m, 8, generator=generator, device="cuda") / 8,
                    index,
                    bf16_randn(m, DSV_HIDDEN, generator=generator),
                )
            )
        args = [
            (mo.gemm2_permuted, mo.expert_weights, mo.expanded_idx_to_permuted_idx, mo.shared_output,
             residual, post, comb, pre, weight, NORM_EPS)
            for mo in moes
        ]  # fmt: skip
        results = run_ranks(ops, "finalize", args)
        check_ranks(results, f"finalize tp {tp} M {m}")
        reduced = run_ranks(
            all_reduce_ranks(tp, DSV_HIDDEN, capacity=CAPACITY, top_k=8), "call", [(mo,) for mo in moes]
        )
        expected = solo(reduced[0], residual, post, comb, pre, weight, NORM_EPS)
        check_against(results, expected, f"finalize tp {tp} M {m}")


@pytest.mark.parametrize("tp", [4, 8])
def test_dsv_fp8_layer_input_two_shot(tp: int) -> None:
    from mhc_core import reference

    fmt = dict(layer_input_format="fp32-g128", layer_input_bf16=True)
    ops = dsv_ops(tp, "two-shot", **fmt)
    (solo,) = dsv_ops(1, "auto", cluster_size=ops[0].config.cluster_size, threads=ops[0].config.threads, **fmt)
    generator = torch.Generator(device="cuda").manual_seed(4720 + tp)
    for m in (1, 40, CAPACITY):
        residual, post, comb, pre, weight = dsv_inputs(m, generator)
        partials = partials_for(tp, m, DSV_HIDDEN, generator)
        results = run_ranks(ops, "call", [(p, residual, post, comb, pre, weight, NORM_EPS) for p in partials])
        check_ranks(results, f"fp8 tp {tp} M {m}")
        expected = solo(reference.all_reduce(partials), residual, post, comb, pre, weight, NORM_EPS)
        check_against(results, expected, f"fp8 tp {tp} M {m}")


@pytest.mark.parametrize("tp", [4, 8])
def test_auto_routes_by_m_eager_and_in_graphs(tp: int) -> None:
    """Below the crossover an "auto" op is the one-shot op, from it the two-shot op; a graph of each
    protocol replays between eager calls of the other."""
    auto = dsv_ops(tp, "auto", two_shot_min_tokens=CROSSOVER)
    one = dsv_ops(tp, "one-shot")
    two = dsv_ops(tp, "two-shot")
    assert auto[0].protocols.two_shot_from == CROSSOVER
    assert auto[0].mailbox.nbytes < one[0].mailbox.nbytes
    generator = torch.Generator(device="cuda").manual_seed(4730 + tp)

    def call(ops, m, data):
        residual, post, comb, pre, weight, partials = data
        return run_ranks(ops, "call", [(p, residual, post, comb, pre, weight, NORM_EPS) for p in partials])

    def fresh(m):
        return (*dsv_inputs(m, generator), partials_for(tp, m, DSV_HIDDEN, generator))

    graphs = {}
    for m in (CROSSOVER - 1, CROSSOVER + 5):
        data = fresh(m)
        call(auto, m, data)  # eager first, then capture (what engines do)
        static = data
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            outputs = call(auto, m, static)
        torch.cuda.current_stream().wait_stream(stream)
        graphs[m] = (graph, static, outputs)
    for round_index in range(3):
        for m, (graph, static, outputs) in graphs.items():
            data = fresh(m)
            for target, source in zip(static[:5], data[:5], strict=True):
                target.copy_(source)
            for target, source in zip(static[5], data[5], strict=True):
                target.copy_(source)
            graph.replay()
            other = CROSSOVER + 5 if m < CROSSOVER else CROSSOVER - 1
            eager = call(auto, other, fresh(other))  # the other protocol, eagerly, between replays
            assert len(eager) == tp
            reference_ops = one if m < CROSSOVER else two
            expected = call(reference_ops, m, static)
            for rank in range(tp):
                for index in range(2):
                    assert_bitwise_equal(
                        outputs[rank][index], expected[rank][index], f"round {round_index} M {m} rank {rank}"
                    )


def glm_ops(tp: int, protocol: str) -> list:
    from mhc_glm5 import AllReduceMhcBoundary

    key = ("two-shot-glm", tp, protocol)
    return cached_ranks(
        key,
        tp,
        lambda group: AllReduceMhcBoundary(
            hidden_size=GLM_HIDDEN, max_num_tokens=CAPACITY, rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0,
            sinkhorn_repeat=20, norm_eps=1e-5, device="cuda", top_k=8, group=group, protocol=protocol,
        ),
    )  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_glm_two_shot_is_the_tp1_op_on_the_reduced_row(tp: int) -> None:
    from mhc_core import reference

    ops = glm_ops(tp, "two-shot")
    (solo,) = glm_ops(1, "auto")
    generator = torch.Generator(device="cuda").manual_seed(4740 + tp)
    for m in (1, 9, 40, CAPACITY):
        residual = bf16_randn(m, 4, GLM_HIDDEN, generator=generator)
        residual[0, 1, :8] = -0.0
        post = torch.rand(m, 4, 1, generator=generator, device="cuda") * 2
        comb = torch.softmax(torch.randn(m, 4, 4, generator=generator, device="cuda"), dim=-1)
        fn = (torch.randn(24, 4 * GLM_HIDDEN, generator=generator, device="cuda") * 0.01).to(torch.bfloat16)
        scale = torch.rand(3, generator=generator, device="cuda") + 0.5
        base = torch.randn(24, generator=generator, device="cuda") * 0.1
        weight = (torch.rand(GLM_HIDDEN, generator=generator, device="cuda") + 0.5).to(torch.bfloat16)
        partials = partials_for(tp, m, GLM_HIDDEN, generator)
        results = run_ranks(ops, "call", [(p, residual, post, comb, fn, scale, base, weight) for p in partials])
        for op in ops:
            op.join()
        check_ranks(results, f"glm tp {tp} M {m}")
        expected = solo(reference.all_reduce(partials), residual, post, comb, fn, scale, base, weight)
        solo.join()
        check_against(results, expected, f"glm tp {tp} M {m}")


@pytest.mark.parametrize("tp", [4])
def test_loopback_two_phases_run_every_ranks_reduce_once(tp: int) -> None:
    """The public ``publish()`` on every rank, then ``collect()`` on each (what a loopback user writes):
    the first two-shot collect runs every rank's reduce, then each rank's boundary; the results are the
    ``run_ranks`` ones. A collect before every rank has published raises instead of waiting forever."""
    ops = dsv_ops(tp, "two-shot")
    generator = torch.Generator(device="cuda").manual_seed(4750)
    m = 19
    residual, post, comb, pre, weight = dsv_inputs(m, generator)
    partials = partials_for(tp, m, DSV_HIDDEN, generator)
    expected = run_ranks(ops, "call", [(p, residual, post, comb, pre, weight, NORM_EPS) for p in partials])
    for op, partial in zip(ops, partials, strict=True):
        op.publish(partial)
    results = [op.collect(residual, post, comb, pre, weight, NORM_EPS) for op in ops]
    for rank in range(tp):
        for index in range(2):
            assert_bitwise_equal(results[rank][index], expected[rank][index], f"rank {rank} output {index}")
    ops[0].publish(partials[0])
    with pytest.raises(RuntimeError, match=r"needs every rank's publish\(\) first; ranks \[1, 2, 3\]"):
        ops[0].collect(residual, post, comb, pre, weight, NORM_EPS)
    for op, partial in zip(ops[1:], partials[1:], strict=True):
        op.publish(partial)
    again = [op.collect(residual, post, comb, pre, weight, NORM_EPS) for op in ops]
    assert_bitwise_equal(again[2][1], expected[2][1], "after the refused collect, the ranks go on")
