"""AllReduceMhcBoundary on the GPU: every GLM preset at its tp (tp 1 and loopback 2, 4, 8), all
four outputs against the reference, plain and MoE input, -0 inputs, bitwise-identical ranks, the
grouped kernels (every tokens-per-cluster size, short last groups), the persistent boundary (few
clusters looping over many groups; bitwise the 8-token kernel's outputs), join(), chained
boundaries and CUDA-graph replays."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.glm5.checks import HC, boundary_inputs, check_boundary
from tests.support import (
    all_reduce_ranks,
    assert_bitwise_equal,
    assert_within,
    bf16_randn,
    bits,
    cached_ranks,
    is_poisoned,
    poison,
    poisoned,
    run_ranks,
)

pytestmark = pytest.mark.gpu

CAPACITY = 1032
BF16_NEGATIVE_ZERO = -0x8000  # as int16: every empty mailbox slot


def preset_names() -> list[str]:
    from tests import presets  # shipped and test presets

    return list(presets.names("glm5"))


def ops_for(name: str) -> list:
    from mhc_glm5 import AllReduceMhcBoundary
    from tests import presets

    preset = presets.get("glm5", name).PRESET
    return cached_ranks(
        ("glm5", name, CAPACITY),
        preset.tp,
        lambda group: AllReduceMhcBoundary.from_config(preset, max_num_tokens=CAPACITY, device="cuda", group=group),
    )


#: Clusters of the persistent boundary under test: few, so that each loops over many groups of 8
#: (up to 43 at CAPACITY) and both staging buffers are reused many times.
LOOPING_CLUSTERS = 3


def persistent_ops_for(name: str) -> list:
    """The preset's ops with the persistent boundary at every M and ``LOOPING_CLUSTERS`` clusters."""
    from mhc_glm5 import AllReduceMhcBoundary
    from tests import presets

    preset = dataclasses.replace(presets.get("glm5", name).PRESET, cluster_tokens=(), persistent_min_tokens=1)
    return cached_ranks(
        ("glm5-persistent", name, CAPACITY),
        preset.tp,
        lambda group: AllReduceMhcBoundary.from_config(
            preset, max_num_tokens=CAPACITY, device="cuda", group=group, clusters=LOOPING_CLUSTERS
        ),
    )


def all_reduce_ops(tp: int, hidden: int, top_k: int) -> list:
    """LamportAllReduce with the boundary's summation tree (4 rank lanes) and finalize publish."""
    return all_reduce_ranks(tp, hidden, capacity=CAPACITY, top_k=top_k, lanes=4)


def poisoned_outputs(m: int, hidden: int) -> tuple:
    return (
        poisoned((m, HC, hidden), torch.bfloat16),
        poisoned((m, HC, 1), torch.float32),
        poisoned((m, HC, HC), torch.float32),
        poisoned((m, hidden), torch.bfloat16),
    )


def moe_inputs(ops, m: int, weight_dtype: torch.dtype, generator: torch.Generator) -> list:
    from mhc_core import MoEOutput

    op = ops[0]
    moes = []
    for _ in ops:
        rows = 2 * m + 1
        index = torch.randint(0, rows, (m, op.top_k), generator=generator, device="cuda", dtype=torch.int32)
        index[torch.rand(m, op.top_k, generator=generator, device="cuda") < 0.3] = -1
        weights = (torch.rand(m, op.top_k, generator=generator, device="cuda") / op.top_k).to(weight_dtype)
        moes.append(
            MoEOutput(
                bf16_randn(rows, op.hidden_size, generator=generator),
                weights,
                index,
                bf16_randn(m, op.hidden_size, generator=generator),
            )
        )
    return moes


def run_and_check(ops, m: int, generator: torch.Generator, *, moe_dtype=None, negative_zero=False):
    from mhc_core import reference

    op = ops[0]
    args = boundary_inputs(m, op.hidden_size, generator, negative_zero=negative_zero)
    outs = [poisoned_outputs(m, op.hidden_size) for _ in ops]
    if moe_dtype is None:
        partials = [bf16_randn(m, op.hidden_size, generator=generator) for _ in ops]
        if negative_zero:
            for partial in partials:
                partial[-1] = -0.0
        xs = partials
        reduced = reference.all_reduce(partials, lanes=4)
    else:
        xs = moe_inputs(ops, m, moe_dtype, generator)
    results = run_ranks(ops, "call", [(x, *args.values()) for x in xs], [dict(out=o) for o in outs])
    if moe_dtype is not None:
        # The kernel's x: the same finalize publish and the same 4-lane tree (bit-identical).
        reduced = run_ranks(all_reduce_ops(op.tp, op.hidden_size, op.top_k), "call", [(x,) for x in xs])[0]
    for rank_op in ops:
        rank_op.join()
    torch.cuda.synchronize()
    for result, out in zip(results, outs, strict=True):
        assert all(r.data_ptr() == o.data_ptr() for r, o in zip(result, out, strict=True))
    check_boundary(op, results, reduced, args, [rank_op.raw_mixes[:m].clone() for rank_op in ops])
    return results, args


@pytest.mark.parametrize("name", preset_names())
def test_preset_against_reference(name: str) -> None:
    ops = ops_for(name)
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, name)))
    for index, m in enumerate((1, 5, 16, 100, CAPACITY)):
        run_and_check(ops, m, generator, negative_zero=index == 1)


@pytest.mark.parametrize("name", preset_names())
def test_every_tokens_per_cluster_with_short_last_group(name: str) -> None:
    """M = k * tokens + 1 for each grouped size: the last group repeats its only token."""
    ops = ops_for(name)
    op = ops[0]
    generator = torch.Generator("cuda").manual_seed(7)
    for threshold, tokens in op.cluster_tokens:
        m = max(threshold, tokens) // tokens * tokens + 1
        assert op.tokens_per_cluster(m) == tokens
        run_and_check(ops, m, generator, negative_zero=True)


def persistent_default_names() -> list[str]:
    """The presets that turn the persistent boundary on themselves (``persistent_min_tokens``)."""
    from tests import presets

    return [name for name in preset_names() if presets.get("glm5", name).PRESET.persistent_min_tokens]


@pytest.mark.parametrize("name", persistent_default_names())
def test_preset_persistent_boundary_from_its_threshold(name: str) -> None:
    """The preset's own persistent boundary, with the default cluster count (as many clusters as
    the device holds): just below its threshold (off), at it, one past it (a short last group)
    and at the capacity, -0 among the inputs."""
    ops = ops_for(name)
    op = ops[0]
    threshold = op.persistent_min_tokens
    generator = torch.Generator("cuda").manual_seed(threshold)
    for index, m in enumerate((threshold - 1, threshold, threshold + 1, CAPACITY)):
        assert op.persistent(m) == (m >= threshold)
        run_and_check(ops, m, generator, negative_zero=index == 1)


def persistent_names() -> list[str]:
    """The presets whose shape the persistent boundary fits (hidden 4608 on 8 CTAs does not)."""
    from mhc_glm5.config import persistent_fits
    from tests import presets

    shapes = {name: presets.get("glm5", name).PRESET for name in preset_names()}
    return [name for name, preset in shapes.items() if persistent_fits(preset.hidden, preset.cluster_size) is None]


@pytest.mark.parametrize("name", persistent_names())
def test_persistent_boundary_against_reference(name: str) -> None:
    """The persistent boundary at every M (3 clusters looping; short last groups; -0 inputs),
    plain calls (the direct read at tp = 1) and MoE input (the mailbox path)."""
    from mhc_core.constants import LAMPORT_GENERATIONS, NEXT_STAGE

    ops = persistent_ops_for(name)
    assert all(op.persistent(1) for op in ops)
    generator = torch.Generator("cuda").manual_seed(sum(map(ord, name)) + 1)
    cases = [(m, None) for m in (1, 8 * LOOPING_CLUSTERS + 1, 8 * 2 * LOOPING_CLUSTERS + 7, CAPACITY)]
    for index, (m, moe_dtype) in enumerate([*cases, (8 * 2 * LOOPING_CLUSTERS + 1, torch.float32)]):
        before = [int(op.mailbox.stage_state[NEXT_STAGE]) for op in ops]
        run_and_check(ops, m, generator, negative_zero=index == 1, moe_dtype=moe_dtype)
        # The mailbox path moves every rank's stage on once (its clusters' arrivals counted to the grid).
        if ops[0].tp > 1 or moe_dtype is not None:
            after = [int(op.mailbox.stage_state[NEXT_STAGE]) for op in ops]
            assert after == [(stage + 1) % LAMPORT_GENERATIONS for stage in before], (m, before, after)
        assert all(int(op._arrivals.item()) == 0 for op in ops)


@pytest.mark.parametrize("tp", (1, 4))
def test_persistent_boundary_is_the_8_token_kernel_looped(tp: int) -> None:
    """Per token the persistent boundary runs the 8-token tensor-core kernel's arithmetic in the same
    order: every output bitwise equal to that kernel's, raw mixes included."""
    from mhc_glm5 import presets

    preset = presets.get(f"h200-tp{tp}-h4096").PRESET
    eight = _ops_with_tokens(preset, 8, capacity=CAPACITY)
    persistent = persistent_ops_for(preset.name)
    generator = torch.Generator("cuda").manual_seed(41 + tp)
    m = 8 * 5 * LOOPING_CLUSTERS + 3
    partials = [bf16_randn(m, preset.hidden, generator=generator) for _ in range(tp)]
    partials[0][1, :8] = -0.0
    args = boundary_inputs(m, preset.hidden, generator, negative_zero=True)
    results = []
    for ops in (eight, persistent):
        assert ops[0].tokens_per_cluster(m) == 8 and ops[0].persistent(m) == (ops is persistent)
        outputs = run_ranks(ops, "call", [(x, *args.values()) for x in partials])
        for op in ops:
            op.join()
        torch.cuda.synchronize()
        results.append((outputs, ops[0].raw_mixes[:m].clone()))
    (eight_outputs, eight_raw), (persistent_outputs, persistent_raw) = results
    for rank, (a, b) in enumerate(zip(eight_outputs, persistent_outputs, strict=True)):
        for name, x, y in zip(("residual_out", "post_out", "comb_out", "layer_input"), a, b, strict=True):
            assert_bitwise_equal(x, y, f"rank {rank}: {name}")
    assert_bitwise_equal(eight_raw, persistent_raw, "raw_mixes")


@pytest.mark.parametrize("weight_dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("name", ["h200-tp1-h4096", "h200-tp2-h4096", "h200-tp4-h4096", "h200-tp8-h4096"])
def test_moe_input(name: str, weight_dtype: torch.dtype) -> None:
    ops = ops_for(name)
    generator = torch.Generator("cuda").manual_seed(13)
    for m in (1, 16, 257):
        run_and_check(ops, m, generator, moe_dtype=weight_dtype)


@pytest.mark.parametrize("tp", (1, 8))
def test_single_and_grouped_kernels_agree(tp: int) -> None:
    """The same tokens through the one-token and every grouped kernel (ops whose thresholds send
    M = 9 to each; tp 8 over loopback): every rank bitwise identical within a kernel; across
    kernels the streams within two post-mix bounds (which product ptxas fuses into an FMA is its
    choice per kernel) and the raw mixes within the two-tree GEMV bound."""
    from mhc_core import reference
    from mhc_glm5 import presets
    from tests.glm5.checks import gemv_depth
    from tests.tolerances import gemv_tolerance, post_mix_tolerance

    preset = presets.get(f"h200-tp{tp}-h4096").PRESET
    generator = torch.Generator("cuda").manual_seed(17 + tp)
    m = 9
    partials = [bf16_randn(m, preset.hidden, generator=generator) for _ in range(tp)]
    args = boundary_inputs(m, preset.hidden, generator)
    results = {}
    for tokens in (1, 2, 4, 8, 16):
        ops = _ops_with_tokens(preset, tokens)
        assert ops[0].tokens_per_cluster(m) == tokens
        outputs = run_ranks(ops, "call", [(x, *args.values()) for x in partials])
        for op in ops:
            op.join()
        torch.cuda.synchronize()
        for rank, rank_outputs in enumerate(outputs[1:], start=1):
            assert torch.equal(rank_outputs[0], outputs[0][0]), f"{tokens} tokens per cluster: rank {rank} differs"
        results[tokens] = (outputs[0], ops[0].raw_mixes[:m].clone(), ops[0])
    single_outputs, single_raw, _ = results[1]
    streams = single_outputs[0].float().reshape(m, -1)
    rstd = torch.rsqrt((streams * streams).sum(-1, keepdim=True) / streams.shape[1] + preset.rms_eps)
    tolerance = gemv_tolerance(single_outputs[0], args["fn"], rstd, gemv_depth(results[16][2]))
    reduced = reference.all_reduce(partials, lanes=4)
    residual, post, comb = args["residual"], args["post"], args["comb"]
    stream_tolerance = 2 * post_mix_tolerance(reduced, residual, post, comb, single_outputs[0])
    for tokens, (outputs, raw, _) in results.items():
        assert_within(outputs[0], single_outputs[0], stream_tolerance, f"{tokens} tokens per cluster: residual_out")
        assert_within(raw, single_raw, tolerance, f"{tokens} tokens per cluster: raw mixes")


def _ops_with_tokens(preset, tokens: int, capacity: int = 16) -> list:
    """Ops of ``preset`` (loopback ranks above tp 1) whose thresholds send every M to ``tokens``
    (the persistent boundary off)."""
    from mhc_glm5 import AllReduceMhcBoundary

    thresholds = ((1, tokens),) if tokens > 1 else ()
    single = dataclasses.replace(preset, cluster_tokens=thresholds, persistent_min_tokens=0)
    return cached_ranks(
        ("glm5-tokens", preset.name, tokens, capacity),
        preset.tp,
        lambda group: AllReduceMhcBoundary.from_config(single, max_num_tokens=capacity, device="cuda", group=group),
    )


@pytest.mark.parametrize("m,kernel", [(1, 1), (20, 2), (40, 8), (200, 16), (300, "persistent")])
def test_tp1_reads_x_without_a_publish(m: int, kernel: int | str) -> None:
    """At tp 1 a plain call launches no publish: the stage state does not move and the mailbox
    stays empty (-0). Its outputs are bitwise those of the mailbox path (publish + collect) on
    the same inputs, -0 in x included. Every kernel: the x1, x8 and x16 kernels as the preset picks
    them, x2 (which the preset no longer picks) by its own thresholds, the persistent boundary."""
    from mhc_glm5 import presets

    if kernel == "persistent":
        op = persistent_ops_for("h200-tp1-h4096")[0]
    elif kernel == 2:
        op = _ops_with_tokens(presets.get("h200-tp1-h4096").PRESET, 2, capacity=32)[0]
    else:
        op = ops_for("h200-tp1-h4096")[0]
    assert op.persistent(m) if kernel == "persistent" else op.tokens_per_cluster(m) == kernel
    generator = torch.Generator("cuda").manual_seed(29 + m)
    args = boundary_inputs(m, op.hidden_size, generator, negative_zero=True)
    x = bf16_randn(m, op.hidden_size, generator=generator)
    x[-1] = -0.0
    x[0, :16] = -0.0
    state = op.mailbox.stage_state.clone()
    assert (bits(op.mailbox.buffer) == BF16_NEGATIVE_ZERO).all()
    direct = op(x, *args.values(), out=poisoned_outputs(m, op.hidden_size))
    op.join()
    torch.cuda.synchronize()
    assert torch.equal(op.mailbox.stage_state, state), "a tp 1 call advanced the stage: it published"
    assert (bits(op.mailbox.buffer) == BF16_NEGATIVE_ZERO).all(), "a tp 1 call wrote into the mailbox"
    direct_raw = op.raw_mixes[:m].clone()
    op.publish(x)
    mailbox = op.collect(*args.values(), out=poisoned_outputs(m, op.hidden_size), after_publish=True)
    op.join()
    torch.cuda.synchronize()
    assert not torch.equal(op.mailbox.stage_state, state), "the two-phase form did not publish"
    for name, a, b in zip(("residual_out", "post_out", "comb_out", "layer_input"), direct, mailbox, strict=True):
        assert_bitwise_equal(a, b, name)
    assert_bitwise_equal(direct_raw, op.raw_mixes[:m], "raw_mixes")


def test_each_call_moves_the_stage_on_once() -> None:
    """The boundaries poll before their PDL wait, reading the stage from NEXT, and their last
    arriving cluster moves it on at the end: every call (one-token and grouped kernels, one to
    dozens of clusters) advances every rank's NEXT by exactly one generation and leaves its arrival
    count at 0 (loopback tp 4: only rank 0's boundary follows its publish; the others wait first)."""
    from mhc_core.constants import LAMPORT_GENERATIONS, NEXT_STAGE

    ops = ops_for("h200-tp4-h4096")
    generator = torch.Generator("cuda").manual_seed(31)
    for m in (1, 15, 100, CAPACITY):
        before = [int(op.mailbox.stage_state[NEXT_STAGE]) for op in ops]
        run_and_check(ops, m, generator)
        after = [int(op.mailbox.stage_state[NEXT_STAGE]) for op in ops]
        assert after == [(stage + 1) % LAMPORT_GENERATIONS for stage in before], (m, before, after)
        assert all(int(op._arrivals.item()) == 0 for op in ops)


def test_join_semantics() -> None:
    """post_out / comb_out are written on the side stream: incomplete before join(), complete after."""
    ops = ops_for("h200-tp1-h4096")
    op = ops[0]
    generator = torch.Generator("cuda").manual_seed(19)
    args = boundary_inputs(4, op.hidden_size, generator)
    outs = poisoned_outputs(4, op.hidden_size)
    torch.cuda._sleep(1)  # load the sleep kernel first
    torch.cuda.synchronize()
    with torch.cuda.stream(op.side_stream):
        torch.cuda._sleep(200_000_000)  # hold the side stream ~100 ms
    op(bf16_randn(4, op.hidden_size, generator=generator), *args.values(), out=outs)
    before = outs[1].clone()
    torch.cuda.current_stream().synchronize()
    assert is_poisoned(before).all(), "post_out was complete before join(): the mixes did not run on the side stream"
    op.join()
    after = outs[1].clone()
    torch.cuda.current_stream().synchronize()
    assert not is_poisoned(after).any()


def test_twenty_chained_boundaries() -> None:
    """Each call's residual_out / post_out / comb_out feed the next, as a model runs them."""
    from mhc_core import reference

    ops = ops_for("h200-tp2-h4096")
    op = ops[0]
    generator = torch.Generator("cuda").manual_seed(23)
    m = 7
    args = boundary_inputs(m, op.hidden_size, generator)
    for _ in range(20):
        partials = [bf16_randn(m, op.hidden_size, generator=generator) for _ in ops]
        outs = [poisoned_outputs(m, op.hidden_size) for _ in ops]
        results = run_ranks(ops, "call", [(p, *args.values()) for p in partials], [dict(out=o) for o in outs])
        for rank_op in ops:
            rank_op.join()
        torch.cuda.synchronize()
        check_boundary(
            op, results, reference.all_reduce(partials, lanes=4), args, [o.raw_mixes[:m].clone() for o in ops]
        )
        args = dict(args, residual=results[0][0].clone(), post=results[0][1].clone(), comb=results[0][2].clone())


@pytest.mark.parametrize("name", ("h200-tp1-h4096", "h200-tp2-h4096"))
@pytest.mark.parametrize("m,persistent", [(1, False), (33, False), (257, False), (257, True)])
def test_cuda_graph_replays(m: int, persistent: bool, name: str) -> None:
    """tp 1: the boundary reads x itself (no publish in the graph); tp 2 (loopback): the mailbox.
    The persistent boundary: 3 clusters looping over 33 groups, replayed."""
    from mhc_core import reference

    ops = (persistent_ops_for if persistent else ops_for)(name)
    op = ops[0]
    generator = torch.Generator("cuda").manual_seed(m)
    partials = [torch.zeros(m, op.hidden_size, dtype=torch.bfloat16, device="cuda") for _ in ops]
    args = boundary_inputs(m, op.hidden_size, generator)
    outs = [poisoned_outputs(m, op.hidden_size) for _ in ops]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_ranks(ops, "call", [(p, *args.values()) for p in partials], [dict(out=o) for o in outs])
        for rank_op in ops:
            rank_op.join()
    for _ in range(200):
        for partial in partials:
            partial.copy_(bf16_randn(m, op.hidden_size, generator=generator))
        for key, value in boundary_inputs(m, op.hidden_size, generator).items():
            args[key].copy_(value)
        for rank_outs in outs:
            for tensor in rank_outs:
                poison(tensor)
        graph.replay()
        torch.cuda.synchronize()
        check_boundary(op, outs, reference.all_reduce(partials, lanes=4), args, [o.raw_mixes[:m].clone() for o in ops])


@pytest.mark.parametrize("name", ("h200-tp1-h4096", "h200-tp2-h4096"))
def test_mixes_kernel_does_not_wait_for_the_boundary_in_a_graph(name: str, tmp_path) -> None:
    """The side stream forks before the boundary: in a captured call no path of dependencies leads
    from the boundary kernel to the mixes kernel (they run alongside, the mixes polling the hand-off
    rows). Read from the graph's own dependency edges (CUDA's debug DOT dump), not from timing."""
    import ctypes
    import re

    ops = ops_for(name)
    op = ops[0]
    generator = torch.Generator("cuda").manual_seed(5)
    partials = [bf16_randn(4, op.hidden_size, generator=generator) for _ in ops]
    args = boundary_inputs(4, op.hidden_size, generator)
    run_ranks(ops, "call", [(p, *args.values()) for p in partials])  # eager first: build -> eager -> capture
    for rank_op in ops:
        rank_op.join()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # the captured graph stays readable
    with torch.cuda.graph(graph):
        run_ranks(ops, "call", [(p, *args.values()) for p in partials])
        for rank_op in ops:
            rank_op.join()
    dump = tmp_path / "graph.dot"
    verbose = 1  # CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE: kernel nodes with their function names
    status = ctypes.CDLL("libcuda.so.1").cuGraphDebugDotPrint(
        ctypes.c_void_p(graph.raw_cuda_graph()), str(dump).encode(), ctypes.c_uint(verbose)
    )
    assert status == 0, f"cuGraphDebugDotPrint: CUresult {status}"
    text = dump.read_text()
    edges: dict[str, set[str]] = {}
    for source, target in re.findall(r'"([^"]+)"\s*->\s*"([^"]+)"', text):
        edges.setdefault(source, set()).add(target)
    # Each node's text runs from its definition to the next one; kernel names carry the class.
    # (An edge's target with its attributes reads like a definition: the first one is the node's.)
    first: dict[str, int] = {}
    for match in re.finditer(r'"([^"]+)"\s*\[', text):
        first.setdefault(match.group(1), match.start())
    starts = sorted((at, node) for node, at in first.items())
    labels = {
        node: text[at : (starts[i + 1][0] if i + 1 < len(starts) else len(text))] for i, (at, node) in enumerate(starts)
    }
    boundaries = [node for node, label in labels.items() if "BoundaryKernel" in label]
    mixes = [node for node, label in labels.items() if "MixesKernel" in label]
    assert boundaries and mixes, f"kernel nodes not found by name in {dump}: {text[:2000]}"

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(edges.get(node, ()))
        return False

    graph.replay()
    torch.cuda.synchronize()

    # Nodes are numbered in launch order: a mixes kernel's own boundary is the last one launched
    # before it (loopback ranks launch in turn, so rank 1's mixes rightly follow rank 0's boundary).
    def number(node: str) -> int:
        return int(node.rpartition("_")[2])

    assert len(mixes) == len(ops) == len(boundaries)
    for mix in mixes:
        own = max((node for node in boundaries if number(node) < number(mix)), key=number)
        assert not reaches(own, mix), "the mixes kernel waits for its boundary (the fork is late)"


def test_side_stream_is_none_of_torchs_pooled_streams() -> None:
    """``torch.cuda.Stream()`` hands out 32 pooled streams per device and priority, round-robin. An
    engine's streams, or a graph's capture stream, taken from that pool must never be the op's
    side stream: the mixes kernel would then queue behind the boundary (the test above failed that
    way late in the suite, once enough streams had been handed out) or the engine's work behind it."""
    op = ops_for("h200-tp1-h4096")[0]
    pooled = {torch.cuda.Stream(priority=priority).cuda_stream for priority in (0, -1) for _ in range(64)}
    side = op.side_stream.cuda_stream
    assert side not in pooled, f"the op's side stream {side:#x} is one of torch's pooled streams"


def mixes_alone(op):
    """The op's mixes kernel launched by itself (with the op's buffers and spin bound)."""
    from mhc_core.host.binaries.launch import BoundKernel

    kernel = op._mixes_kernel
    fixed = dict(
        mixes=op._mixes_handoff, raw_out=op.raw_mixes, spin_limit_ns=op.spin.handoff_limit_ns,
        error_flag=op.spin.address, state=op.state.data_ptr(),
    )  # fmt: skip
    return BoundKernel(kernel.function, kernel.signature, fixed, op.device)


def test_mixes_kernel_gives_up_on_raw_mixes_never_written() -> None:
    """The side-stream mixes kernel polls each token's hand-off row with the op's spin bound:
    a boundary that never ran makes it report and finish instead of hanging."""
    from mhc_core import LamportTimeoutError
    from mhc_glm5 import AllReduceMhcBoundary, presets

    op = AllReduceMhcBoundary.from_config(
        presets.get("h200-tp1-h4096").PRESET, max_num_tokens=8, device="cuda", spin_timeout_ms=50.0
    )
    scale, base = torch.ones(3, device="cuda"), torch.zeros(24, device="cuda")
    post_out, comb_out = poisoned((3, HC, 1), torch.float32), poisoned((3, HC, HC), torch.float32)
    torch.cuda.synchronize()
    mixes_alone(op)(scale=scale, base=base, post_out=post_out, comb_out=comb_out, m=3)
    torch.cuda.synchronize()  # returns: the kernel gave up on its own
    assert is_poisoned(post_out).all() and is_poisoned(comb_out).all()
    with pytest.raises(LamportTimeoutError, match="hand-off row"):
        op.check()
