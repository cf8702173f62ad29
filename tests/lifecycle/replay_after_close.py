"""A CUDA graph replayed after the op it captured was closed, as a user's process does it (issue
#32): ``python -m tests.lifecycle.replay_after_close MODEL TARGET`` (MODEL core, dsv or glm; TARGET
a tp for core, a preset name otherwise). Run in a child process by
``test_replay_after_close_gpu``: before the fix the replay crashed the process (SIGSEGV).

The sequence: build, capture one call of every rank, replay it (checked against the reference),
``close()`` every rank, allocate tensors of every size the op freed or could have freed (filled
with a canary pattern), replay again, then drop the ops and replay once more. The replays must
write NaN into the graph's outputs, touch no canary, and every later host call must raise."""

from __future__ import annotations

import gc
import sys

import torch

from tests.lifecycle.common import CORE, DSV, GLM, as_tuple, assert_written_nan, core_ops, dsv_ops, glm_ops, poison_all

CAPACITY = 16
M = 5
#: int16 canary: neither a NaN, a -0 nor anything a kernel writes.
CANARY = 0x5A5A


def _build(model_name: str, target: str) -> tuple:
    if model_name == "core":
        return CORE, core_ops(int(target), CAPACITY)
    if model_name == "dsv":
        return DSV, dsv_ops(target, CAPACITY)
    return GLM, glm_ops(target, CAPACITY)


def _freed_sizes(ops: list) -> list[int]:
    """Byte sizes of every device buffer the ops own (what close() frees or keeps)."""
    sizes: set[int] = set()
    for op in ops:
        for tensor in (op.mailbox.memory, op.mailbox.stage_state, op.mailbox.destinations):
            sizes.add(tensor.nbytes)
        for name in ("_mixes_handoff", "_raw_mixes", "_arrivals"):
            tensor = getattr(op, name, None)
            if isinstance(tensor, torch.Tensor):
                sizes.add(tensor.nbytes)
    return sorted(sizes)


def _canaries(sizes: list[int]) -> list[torch.Tensor]:
    """Three tensors of each size (torch's allocator hands freed blocks of that size out first)."""
    return [
        torch.full((max(size // 2, 1),), CANARY, dtype=torch.int16, device="cuda") for size in sizes for _ in range(3)
    ]


def _assert_untouched(canaries: list[torch.Tensor], what: str) -> None:
    torch.cuda.synchronize()
    for canary in canaries:
        changed = int((canary != CANARY).sum())
        assert changed == 0, f"{what}: a replay wrote {changed} elements of a tensor allocated after close()"


def main(model_name: str, target: str) -> None:
    model, ops = _build(model_name, target)
    generator = torch.Generator("cuda").manual_seed(32)
    case, outs = model.case(ops, M, generator, negative_zero=True), model.outputs(ops, M)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.call(ops, case, outs)
    graph.replay()
    model.check(ops, outs, case)
    sizes = _freed_sizes(ops)

    for op in ops:
        op.close()
    canaries = _canaries(sizes)
    poison_all(outs)
    graph.replay()
    _assert_untouched(canaries, "after close()")
    for rank, rank_outs in enumerate(outs):
        for index, tensor in enumerate(as_tuple(rank_outs)):
            assert_written_nan(tensor, f"rank {rank} output {index} of a replay after close()")
    for rank, op in enumerate(ops):
        try:
            model.call_rank(op, case, rank, outs[rank])
        except RuntimeError as error:
            assert "closed" in str(error), error
        else:
            raise AssertionError(f"rank {rank}: a call after close() did not raise")

    del ops, op
    gc.collect()
    more = _canaries(sizes)
    graph.replay()
    _assert_untouched(canaries + more, "after close() and the ops dropped")
    print("replay after close: ok")


if __name__ == "__main__":
    main(*sys.argv[1:3])
