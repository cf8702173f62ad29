"""The side stream's memory outlives what the user drops (GLM tp 1): post_out / comb_out dropped
inside a capture before join() are not handed to the next allocation of the capture; and an op
dropped right after an un-joined eager call keeps its hand-off rows and raw mixes until its late
mixes kernel finished."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.lifecycle.common import GLM, glm_ops, overlaps, sleep_cycles

pytestmark = pytest.mark.gpu

NAME = "h200-tp1-h4096"
CAPACITY = 16
MIX = 24
PATTERN = 1234.5


@pytest.mark.parametrize("m", (3, CAPACITY))
def test_outputs_dropped_inside_capture_are_not_reused_before_join(m: int) -> None:
    [op] = glm_ops(NAME, CAPACITY)
    case = GLM.case([op], m, torch.Generator("cuda").manual_seed(m))
    # One joined eager call first: this test is about memory, not about capturing right after
    # construction (test_capture_gpu covers that).
    GLM.call([op], case, GLM.outputs([op], m))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        residual_out, post_out, comb_out, layer_input = op(*GLM.rank_args(case, 0))
        dropped = [(t.data_ptr(), t.nbytes) for t in (post_out, comb_out)]
        shapes = [(t.shape, t.dtype) for t in (post_out, comb_out)]
        del post_out, comb_out  # the side kernel still writes them until join()
        fresh = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes for _ in range(4)]
        for tensor in fresh:
            tensor.fill_(PATTERN)  # on the main stream, alongside the side kernel
        op.join()
    for tensor in fresh:
        assert not overlaps(tensor, dropped), "an allocation before join() got memory the side kernel writes"
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for index, tensor in enumerate(fresh):
            assert (tensor == PATTERN).all(), f"replay {replay}: pattern tensor {index} was overwritten"
    assert residual_out.isfinite().all() and layer_input.isfinite().all()


def test_dropped_op_keeps_its_buffers_until_its_side_kernel_finished() -> None:
    # The op lives in a memory pool of its own: once it is dropped, the pool's next allocations can
    # only be served from its freed memory (or new segments).
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        [op] = glm_ops(NAME, CAPACITY)
    case = GLM.case([op], CAPACITY, torch.Generator("cuda").manual_seed(5))
    # Long enough to cover gc.collect() in a process holding the DSL.
    cycles = sleep_cycles(1000.0)
    raw_mixes = [(op.raw_mixes.data_ptr(), op.raw_mixes.nbytes)]
    with torch.cuda.stream(op.side_stream):
        torch.cuda._sleep(cycles)  # the mixes kernel of the next call runs ~1 s late
    residual_out, post_out, comb_out, layer_input = op(*GLM.rank_args(case, 0))
    side_done = torch.cuda.Event()
    side_done.record(op.side_stream)
    del op, post_out, comb_out, layer_input
    gc.collect()
    # [capacity, 24] FP32 tensors enough to cover every byte the pool holds: any buffer of the op
    # already freed (its hand-off rows, its raw mixes) is handed out among them.
    reserved = sum(segment["total_size"] for segment in pool.snapshot())
    count = reserved // (CAPACITY * MIX * 4) + 1
    with torch.cuda.use_mem_pool(pool):
        patterns = [torch.full((CAPACITY, MIX), PATTERN, device="cuda") for _ in range(count)]
    assert not side_done.query(), "the side stream finished before the allocations: the test tested nothing"
    assert not any(overlaps(t, raw_mixes) for t in patterns), "a new allocation got the raw mixes of a queued kernel"
    torch.cuda.synchronize()
    intact = torch.stack(patterns) == PATTERN
    assert intact.all(), f"{int((~intact).sum())} pattern elements overwritten by the dropped op's mixes kernel"
    assert residual_out.isfinite().all()
