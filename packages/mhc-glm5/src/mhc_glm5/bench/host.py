"""GLM-5.3's paths of the host-overhead suite (``--suite host``, ``benchmarks.host``): eager calls
(each joined: the side-stream mixes) with outputs allocated by the op and given (``out=``), the
custom-op paths, loopback tp 2."""

from __future__ import annotations

from typing import Any

import torch

from mhc_core.bench.host import Step
from mhc_core.bench.records import bf16


def host_steps(case: Any, m: int, device: torch.device) -> list[Step]:
    from mhc_core import LoopbackGroup, run_ranks
    from mhc_glm5 import library

    def fresh() -> tuple:
        return (bf16(m, case.hidden), *case.inputs(m, case.hidden))

    op = case.build(case.preset(1), max(m, 8), device)
    args = fresh()

    def call() -> None:
        op(*args)
        op.join()

    # With the caller's outputs (an engine's preallocated buffers): the same call without torch's
    # output allocations, i.e. everything the op itself costs.
    out = op(*args)
    op.join()

    def call_out() -> None:
        op(*args, out=out)
        op.join()

    # The custom-op path: the typed wrappers (eager: the op's own call, ``mhc_core.host.library.eager``)
    # and the torch.ops.mhc ops called by hand (the dispatcher's one Python kernel).
    def library_step() -> None:
        fused = library.boundary(op, *args)
        library.join(op, fused[0])

    def ops_step() -> None:
        fused = torch.ops.mhc.glm5_boundary(op.state, op.handle, *args)
        torch.ops.mhc.glm5_join(op.state, op.handle, fused[0])

    group = LoopbackGroup(2, device)
    ranks = [case.build(case.preset(2), 8, device, group=rank) for rank in group]
    ranks_args = [fresh() for _ in group]

    def ranks_step() -> None:
        run_ranks(ranks, "call", ranks_args)
        for rank in ranks:
            rank.join()

    return [
        Step("AllReduceMhcBoundary.__call__ + join()", 1, call, 2),
        Step("AllReduceMhcBoundary.__call__(out=...) + join()", 1, call_out, 2),
        Step("mhc_glm5.library.boundary + join", 1, library_step, 2),
        Step("torch.ops.mhc.glm5_boundary + glm5_join", 1, ops_step, 2),
        Step("AllReduceMhcBoundary.__call__ + join(), per rank", 2, ranks_step, 3, 2),
    ]
