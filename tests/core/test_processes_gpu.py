"""Ranks as processes on one GPU (a gloo group), through the CUDA IPC mailbox allocation: the
engine's shape (one process per rank), which torch symmetric memory refuses on one GPU; and the
startup votes with real processes on the device (a rank that fails after the config vote, a
spin-bound difference between loopback ranks). The whole multi-process suite is
``tests.multigpu.run --procs-per-gpu``; these are its smallest cases, in the GPU suite."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.processes import run_ranks_as_processes
from tests.support import assert_bitwise_equal, bf16_randn, poisoned

pytestmark = pytest.mark.gpu
SPIN_MS = 20_000.0


def _all_reduce_ranks(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    from mhc_core import LamportAllReduce, reference

    torch.cuda.set_device(0)
    import torch.distributed as dist

    op = LamportAllReduce(
        hidden_size=4096, max_num_tokens=64, device="cuda:0", group=dist.group.WORLD, spin_timeout_ms=SPIN_MS, **options
    )
    generator = torch.Generator("cuda").manual_seed(31)  # every rank draws every rank's partials
    for m in (1, 7, 64, 3):
        partials = [bf16_randn(m, 4096, generator=generator) for _ in range(world)]
        partials[0][0] = -0.0
        out = poisoned((m, 4096), torch.bfloat16)
        result = op(partials[rank], out=out)
        assert_bitwise_equal(result, reference.all_reduce(partials), f"rank {rank}, M = {m}")
    allocation = op.mailbox.allocation if op.mailbox is not None else "?"
    op.close()
    return {"allocation": allocation}


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_as_processes_on_one_gpu_all_reduce_bitwise(world):
    outcomes = run_ranks_as_processes(_all_reduce_ranks, world, {})
    for rank, outcome in outcomes.items():
        assert outcome.kind == "ok", f"rank {rank}: {outcome.message}"
        assert outcome.value == {"allocation": "ipc"}, outcome.value


def test_symmetric_memory_on_a_shared_gpu_is_refused_on_every_rank():
    outcomes = run_ranks_as_processes(_all_reduce_ranks, 2, {"mailbox_allocation": "symmetric"})
    for rank, outcome in outcomes.items():
        assert outcome.kind == "ValueError", f"rank {rank}: {outcome}"
        assert "share one GPU" in outcome.first_line and "'ipc'" in outcome.first_line, outcome.first_line


def _one_rank_out_of_memory(rank: int, world: int) -> None:
    """Every rank asks for the same op; rank 1 finds no free memory for its mailbox (after the
    config vote, before any allocation)."""
    import torch.distributed as dist

    from mhc_core import LamportAllReduce

    torch.cuda.set_device(0)
    if rank == 1:
        torch.cuda.mem_get_info = lambda device=None: (0, 1 << 40)  # type: ignore[assignment]
    LamportAllReduce(hidden_size=4096, max_num_tokens=64, device="cuda:0", group=dist.group.WORLD)


def test_a_rank_that_fails_before_allocating_stops_its_peers():
    outcomes = run_ranks_as_processes(_one_rank_out_of_memory, 2, deadline_s=120.0)
    assert outcomes[1].kind == "ValueError" and "does not fit" in outcomes[1].first_line, outcomes[1]
    assert outcomes[0].kind == "StartupError", outcomes[0]
    assert "rank 1" in outcomes[0].first_line and "does not fit" in outcomes[0].first_line, outcomes[0].first_line


def test_loopback_ranks_with_different_spin_bounds_are_refused_at_construction():
    from mhc_core import LoopbackGroup
    from mhc_core.host.ranks.startup import StartupError
    from mhc_dsv41 import AllReduceMHC

    group = LoopbackGroup(2, "cuda")
    arguments = dict(hidden_size=5120, hc_mult=4, max_num_tokens=16, top_k=8, device="cuda")
    first = AllReduceMHC(**arguments, group=group[0], spin_timeout_ms=5000.0)
    with pytest.raises(StartupError, match=r"spin_timeout_ms: rank 0 = 5000.0, rank 1 = 7000.0"):
        AllReduceMHC(**arguments, group=group[1], spin_timeout_ms=7000.0)
    assert not first.ready  # rank 1 never joined: rank 0's op stays unusable, and says so
