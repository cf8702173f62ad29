"""Issue #52, the ``IpcAllocator`` bullet, on a CPU with real processes (a gloo group): rank 1's
exported mailbox handle maps a smaller allocation than the configuration every rank voted (a
foreign build, a bug). Mapped as it was, rank 0's kernels would store past it; the mapping must be
held to the voted size, and the failure reach rank 1 in the next vote. The CUDA parts (cudaMalloc,
the IPC export and mapping, the mapped range's size) are stood in for: a handle carries the size
of the allocation it maps."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.processes import run_ranks_as_processes

ELEMENTS = 4096


def _allocate(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from mhc_core.host.ranks import allocation, cuda_ipc
    from mhc_core.host.ranks.groups import resolve_group
    from mhc_core.host.ranks.startup import construction

    class Allocation:
        def __init__(self, nbytes: int, device: Any) -> None:
            self.nbytes, self.pointer = nbytes, 0x1000 * (rank + 1)

        def tensor(self, dtype: torch.dtype, elements: int) -> torch.Tensor:
            return torch.empty(elements, dtype=dtype)

        def handle(self) -> bytes:
            exported = self.nbytes // 2 if rank == 1 else self.nbytes  # rank 1 exports a smaller allocation
            return exported.to_bytes(8, "little") * 8

    def mapping(handle: bytes, device: Any) -> Any:
        return SimpleNamespace(pointer=0x9000, nbytes=int.from_bytes(handle[:8], "little"))

    cuda_ipc.DeviceAllocation, cuda_ipc.PeerMapping = Allocation, mapping
    torch.cuda.synchronize = lambda device=None: None
    group = dist.group.WORLD
    with construction(group, "LamportAllReduce") as startup:
        allocation.IpcAllocator().allocate(resolve_group(group), startup, ELEMENTS, torch.device("cuda", 0))
        startup.vote("mapped", {})  # what the op votes next, before its warm-up
    return {}


def test_a_peer_handle_mapping_less_than_the_voted_mailbox_is_refused_on_every_rank():
    outcomes = run_ranks_as_processes(_allocate, 2, deadline_s=90.0)
    assert outcomes[0].kind == "ValueError", f"rank 0 mapped a short mailbox: {outcomes[0]}"
    assert "rank 1's mailbox handle maps 4096 bytes, expected at least 8192" in outcomes[0].first_line
    assert outcomes[1].kind == "StartupError" and "rank 0: ValueError" in outcomes[1].first_line, outcomes[1]
