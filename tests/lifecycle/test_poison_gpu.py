"""A spin timeout poisons the op on the rank that timed out (loopback tp 2): every later kernel
of it, queued eagerly or replayed from a graph, returns at once and writes NaN into every output;
check() and every later call raise LamportTimeoutError naming the missing rank and asking for a
rebuild; rebuilt ops work. A GLM peer that is late but inside the bound is waited for, the
side-stream hand-off included."""

from __future__ import annotations

import time

import pytest
import torch

from tests.dsv41.test_allreduce_mhc_gpu import NORM_EPS
from tests.lifecycle.common import DSV, GLM, assert_written_nan, dsv_ops, glm_ops, poison_all, sleep_cycles

pytestmark = pytest.mark.gpu

TIMEOUT_MS = 100.0
CAPACITY = 8
M = 4
FAST_S = 0.05  # a poisoned round: well under the 100 ms bound


def timed(*graphs: torch.cuda.CUDAGraph) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def test_dsv_timeout_poisons_every_later_round_of_graphs() -> None:
    from mhc_core import LamportTimeoutError

    ops = dsv_ops("h200-tp2-h5120", CAPACITY, spin_timeout_ms=TIMEOUT_MS)
    generator = torch.Generator("cuda").manual_seed(1)
    case, outs = DSV.case(ops, M, generator), DSV.outputs(ops, M)
    # One graph per rank and phase; capturing runs nothing, so publish / collect pairs stay balanced.
    publish, collect = [], []
    for rank, op in enumerate(ops):
        publish.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(publish[-1]):
            op.publish(case.partials[rank])
        collect.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(collect[-1]):
            op.collect(*case.shared, NORM_EPS, out=outs[rank])
    # Rank 0 alone: rank 1 has not published, so rank 0's collective gives up after the bound.
    assert timed(publish[0], collect[0]) < 5.0
    # Rank 1 late: its collective finds rank 0's publish and its own.
    timed(publish[1], collect[1])
    ops[1].check()
    DSV.check(ops[1:], outs[1:], case)
    for index in range(4):
        DSV.refill(case, ops, generator)
        poison_all(outs[:1])
        elapsed = timed(publish[0], collect[0])
        assert elapsed < FAST_S, f"round {index}: {elapsed * 1e3:.1f} ms: the poisoned collective spun"
        for name, tensor in zip(DSV.names, outs[0], strict=True):
            assert_written_nan(tensor, f"round {index} rank 0 {name}")
    with pytest.raises(LamportTimeoutError, match="rebuild") as caught:
        ops[0].check()
    assert caught.value.missing_ranks == (1,)
    with pytest.raises(LamportTimeoutError, match="rebuild"):
        ops[0](*DSV.rank_args(case, 0))
    # Recovery: a rebuilt op on every rank.
    rebuilt = dsv_ops("h200-tp2-h5120", CAPACITY, spin_timeout_ms=TIMEOUT_MS)
    fresh = DSV.case(rebuilt, M, generator)
    DSV.check(rebuilt, DSV.call(rebuilt, fresh, DSV.outputs(rebuilt, M)), fresh)


def test_glm_timeout_poisons_an_already_queued_call() -> None:
    from mhc_core import LamportTimeoutError

    ops = glm_ops("h200-tp2-h4096", CAPACITY, spin_timeout_ms=TIMEOUT_MS)
    case = GLM.case(ops, M, torch.Generator("cuda").manual_seed(2))
    [first, queued] = GLM.outputs(ops, M)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        GLM.call_rank(ops[0], case, 0, first)  # rank 1 never calls: this one times out
        # Enqueued while the first still spins, so its Python check passes: the device must refuse it.
        GLM.call_rank(ops[0], case, 0, queued)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 5.0
    for name, tensor in zip(GLM.names, queued, strict=True):
        assert_written_nan(tensor, f"queued call {name}")
    with pytest.raises(LamportTimeoutError, match="rebuild") as caught:
        GLM.call_rank(ops[0], case, 0, None)  # the next call is refused before any launch
    assert caught.value.missing_ranks == (1,)
    with pytest.raises(LamportTimeoutError, match="rebuild"):
        ops[0].check()


def test_glm_timeout_poisons_a_graph_replayed_after_it() -> None:
    from mhc_core import LamportTimeoutError

    ops = glm_ops("h200-tp2-h4096", CAPACITY, spin_timeout_ms=TIMEOUT_MS)
    generator = torch.Generator("cuda").manual_seed(3)
    case = GLM.case(ops, M, generator)
    # One joined round of both ranks first (this test is not about capturing right after construction).
    GLM.check(ops, GLM.call(ops, case, GLM.outputs(ops, M)), case)
    # Rank 0's call captured before anything failed: a replay is enqueued with no Python check.
    [graph_outs] = GLM.outputs(ops[:1], M)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        GLM.call_rank(ops[0], case, 0, graph_outs)
    GLM.call_rank(ops[0], case, 0, None)  # rank 1 never calls: this one times out
    torch.cuda.synchronize()
    poison_all([graph_outs])
    elapsed = timed(graph)
    assert elapsed < FAST_S, f"replay after the timeout took {elapsed * 1e3:.1f} ms: it spun"
    for name, tensor in zip(GLM.names, graph_outs, strict=True):
        assert_written_nan(tensor, f"replay {name}")
    with pytest.raises(LamportTimeoutError, match="rebuild") as caught:
        ops[0].check()
    assert caught.value.missing_ranks == (1,)


def test_glm_waits_for_a_late_peer_inside_the_bound() -> None:
    """Rank 1 arrives ~250 ms late against a 400 ms bound: rank 0's boundary and its side-stream
    mixes kernel (which polls the hand-off rows from the start) both wait."""
    ops = glm_ops("h200-tp2-h4096", CAPACITY, spin_timeout_ms=400.0)
    generator = torch.Generator("cuda").manual_seed(4)
    case, outs = GLM.case(ops, M, generator), GLM.outputs(ops, M)
    late = sleep_cycles(250.0)
    streams = [torch.cuda.Stream() for _ in ops]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(streams[0]):
        start.record()
        results = [GLM.call_rank(ops[0], case, 0, outs[0])]
        done.record()
    with torch.cuda.stream(streams[1]):
        torch.cuda._sleep(late)
        results.append(GLM.call_rank(ops[1], case, 1, outs[1]))
    torch.cuda.synchronize()
    for op in ops:
        op.check()
    assert start.elapsed_time(done) > 150.0, "rank 0 did not wait for rank 1: the test tested nothing"
    GLM.check(ops, results, case)
