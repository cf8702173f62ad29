"""Where a process group's mailboxes live: one interface (``MailboxAllocator``), two allocations.

* ``"symmetric"``: torch symmetric memory (``torch.distributed._symmetric_memory``): every rank's
  buffer and, where the driver and the group allow it, an NVLink multicast mapping (what
  ``transport="multicast"`` needs). It refuses two ranks on one GPU.
* ``"ipc"``: a plain ``cudaMalloc`` per rank, its CUDA IPC handle exchanged over the process group
  and mapped by every peer (``mhc_core.host.ranks.cuda_ipc``; the approach of vLLM's custom all-reduce).
  It serves ranks that are processes on one GPU (the project's one-GPU multi-process suite) and
  engines where symmetric memory is unavailable or misbehaves. Any backend's group works (gloo
  too: NCCL refuses two ranks on one GPU). No multicast.

The op's ``mailbox_allocation`` argument, else ``MHC_MAILBOX_ALLOCATION``, else ``"auto"``, picks
one. ``"auto"`` takes ``"ipc"`` when two ranks of the group share a GPU (the ranks' GPU UUIDs travel
in the startup's ``kernels`` vote, so every rank decides alike) and ``"symmetric"`` otherwise.
Ranks, loopback ranks and tp = 1 ops have no process group: their mailbox is a local buffer.

Both allocations take part in the startup's votes (``mhc_core.host.ranks.startup``): a rank whose local
allocation fails says so before any peer enters a rendezvous or maps anything.

Adding a third: NVLink fabric handles for multi-node NVLink (GB200 / GB300 NVL72, where tp 16 lives).
A ``FabricAllocator`` would ``cuMemCreate`` the mailbox with ``CU_MEM_HANDLE_TYPE_FABRIC``, export it
(``cuMemExportToShareableHandle``), exchange the handles with ``startup.vote`` as ``IpcAllocator``
does, and on each peer ``cuMemImportFromShareableHandle`` + ``cuMemAddressReserve`` / ``cuMemMap`` /
``cuMemSetAccess``; it returns a ``MailboxMemory`` like the others and is registered in
``ALLOCATORS``, and ``"auto"`` would take it when the ranks span hosts of one NVLink domain (the
hostnames and the fabric's cluster UUID would travel as facts in the ``kernels`` vote). Nothing
else changes: the kernels only see peer base addresses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...constants import NEGATIVE_ZERO_BF16

ALLOCATION_ENV = "MHC_MAILBOX_ALLOCATION"
ALLOCATIONS = ("auto", "symmetric", "ipc")


@dataclass
class MailboxMemory:
    """This rank's mailbox and where every rank's copy lives. ``owners`` keeps the allocation and the
    peers' mappings alive as long as the mailbox (they free and unmap when collected)."""

    local: torch.Tensor
    peer_bases: list[int]
    multicast: int = 0
    owners: tuple[Any, ...] = field(default=(), repr=False)


def fill_sentinel(buffer: torch.Tensor) -> torch.Tensor:
    """Every element BF16 -0: an empty slot of the Lamport protocol."""
    buffer.view(torch.int16).fill_(NEGATIVE_ZERO_BF16 - 0x10000)
    return buffer


def requested_allocation(requested: str | None) -> str:
    """The explicit argument, else ``MHC_MAILBOX_ALLOCATION``, else ``"auto"`` (validated)."""
    if requested is None:
        requested = os.environ.get(ALLOCATION_ENV, "").strip() or "auto"
        source = ALLOCATION_ENV
    else:
        source = "mailbox_allocation"
    if not isinstance(requested, str):
        raise TypeError(f"{source}: expected one of {ALLOCATIONS}, got {type(requested).__name__} {requested!r}")
    if requested not in ALLOCATIONS:
        raise ValueError(f"{source}: expected one of {ALLOCATIONS}, got {requested!r}")
    return requested


def choose_allocation(requested: str, devices: Sequence[str], transport: str) -> str:
    """The allocation of a process group whose ranks run on ``devices`` (GPU UUIDs, in rank order)."""
    shared = _shared_device(devices)
    if requested == "auto":
        return "ipc" if shared else "symmetric"
    if requested == "symmetric" and shared:
        raise ValueError(
            f"mailbox_allocation='symmetric': ranks {shared} share one GPU, which torch symmetric memory cannot "
            "map twice: use 'ipc' (or 'auto')"
        )
    if requested == "ipc" and transport == "multicast":
        raise ValueError(
            "mailbox_allocation='ipc' has no NVLink multicast mapping: transport='multicast' needs 'symmetric'"
        )
    return requested


def _shared_device(devices: Sequence[str]) -> list[int]:
    """The ranks of the first GPU that more than one rank runs on (empty: one GPU per rank)."""
    ranks: dict[str, list[int]] = {}
    for rank, device in enumerate(devices):
        ranks.setdefault(device, []).append(rank)
    return next((found for found in ranks.values() if len(found) > 1), [])


def device_identity(device: torch.device) -> str:
    """What tells two ranks' GPUs apart across processes: the GPU's UUID."""
    return str(torch.cuda.get_device_properties(device).uuid)


class MailboxAllocator(Protocol):
    """Allocates every rank's mailbox of a process group, collectively (see the module docstring)."""

    name: str

    def allocate(self, group: Any, startup: Any, elements: int, device: torch.device) -> MailboxMemory:
        """``elements`` BF16 of sentinel-filled mailbox on this rank, every peer's base mapped."""
        ...


class SymmetricAllocator:
    """torch symmetric memory: allocate locally, vote, then the rendezvous (which every rank reaches)."""

    name = "symmetric"

    def allocate(self, group: Any, startup: Any, elements: int, device: torch.device) -> MailboxMemory:
        import torch.distributed._symmetric_memory as symm_mem

        local = fill_sentinel(symm_mem.empty((elements,), dtype=torch.bfloat16, device=device))
        torch.cuda.synchronize(device)
        startup.vote("allocated", {}, device=device)  # every rank holds its buffer: none waits alone below
        handle = symm_mem.rendezvous(local, group.group)
        peers = [int(pointer) for pointer in handle.buffer_ptrs]
        return MailboxMemory(local, peers, int(handle.multicast_ptr or 0), owners=(handle,))


class IpcAllocator:
    """``cudaMalloc`` + CUDA IPC handles exchanged through the startup's votes."""

    name = "ipc"

    def allocate(self, group: Any, startup: Any, elements: int, device: torch.device) -> MailboxMemory:
        from .cuda_ipc import DeviceAllocation, PeerMapping

        nbytes = elements * 2
        allocation = DeviceAllocation(nbytes, device)
        local = fill_sentinel(allocation.tensor(torch.bfloat16, elements))
        torch.cuda.synchronize(device)  # filled before any peer can store into it
        # The size every rank computed from the voted configuration is compared too; then each
        # mapping is held to it: a handle to a smaller allocation (a foreign build, a bug) would
        # let this rank's kernels store past a peer's mailbox.
        handles = startup.vote("allocated", {"mailbox_bytes": nbytes}, facts=allocation.handle(), device=device)
        mappings = [None if rank == group.rank else PeerMapping(handle, device) for rank, handle in enumerate(handles)]
        for rank, mapping in enumerate(mappings):
            if mapping is not None and mapping.nbytes < nbytes:
                raise ValueError(
                    f"mailbox_allocation='ipc': rank {rank}'s mailbox handle maps {mapping.nbytes} bytes, expected at "
                    f"least {nbytes} (the voted max_num_tokens, hidden and tp): build the same op, from the same "
                    "packages, on every rank"
                )
        peers = [allocation.pointer if mapping is None else mapping.pointer for mapping in mappings]
        return MailboxMemory(local, peers, owners=(allocation, *(m for m in mappings if m is not None)))


ALLOCATORS: dict[str, MailboxAllocator] = {"symmetric": SymmetricAllocator(), "ipc": IpcAllocator()}
