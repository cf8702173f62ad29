"""DSV4.1's paths of the host-overhead suite (``--suite host``, ``benchmarks.host``): eager calls with
outputs allocated by the op and given (``out=``), the MoE finalize, the custom-op paths, loopback tp 2."""

from __future__ import annotations

from typing import Any

import torch

from mhc_core.bench.host import Step
from mhc_core.bench.records import bf16


def _moe_args(m: int, top_k: int, hidden: int = 5120) -> tuple:
    rows = m * top_k
    return (
        bf16(rows, hidden), torch.rand(m, top_k, device="cuda"),
        torch.randperm(rows, device="cuda").to(torch.int32).view(m, top_k), bf16(m, hidden),
    )  # fmt: skip


def host_steps(case: Any, m: int, device: torch.device) -> list[Step]:
    from mhc_core import LoopbackGroup, run_ranks
    from mhc_dsv41 import library

    def fresh() -> tuple:
        return (bf16(m, case.hidden), *case.inputs(m, case.hidden))

    op = case.build(case.preset(1), max(m, 8), device)
    args = fresh()
    moe = _moe_args(m, op.top_k)
    # With the caller's outputs (an engine's preallocated buffers): the same call without torch's
    # output allocations, i.e. everything the op itself costs.
    out = op(*args)
    # The custom-op path: the typed wrapper (eager: the op's own call, ``mhc_core.host.library.eager``)
    # and the torch.ops.mhc op called by hand (the dispatcher's one Python kernel).
    ops_args = (op.state, op.handle, *args)  # args end with the norm eps
    group = LoopbackGroup(2, device)
    ranks = [case.build(case.preset(2), 8, device, group=rank) for rank in group]
    ranks_args = [fresh() for _ in group]
    return [
        Step("AllReduceMHC.__call__", 1, lambda: op(*args), 1),
        Step("AllReduceMHC.finalize", 1, lambda: op.finalize(*moe, *args[1:]), 2),
        Step("AllReduceMHC.__call__(out=...)", 1, lambda: op(*args, out=out), 1),
        Step("mhc_dsv41.library.boundary", 1, lambda: library.boundary(op, *args), 1),
        Step("torch.ops.mhc.dsv41_boundary", 1, lambda: torch.ops.mhc.dsv41_boundary(*ops_args), 1),
        Step("AllReduceMHC.__call__, per rank", 2, lambda: run_ranks(ranks, "call", ranks_args), 2, 2),
    ]
