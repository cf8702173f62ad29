"""The Lamport mailbox of one rank: slots, stage state and where publishes go.

Memory: ``3 * tp * capacity * hidden * 2`` bytes per rank (three generations of
every rank's ``[capacity, hidden]`` BF16 contribution) plus a ``3 * tp * 16``-byte
header (each rank's M per generation, for the unequal-M check), and 16 bytes of
stage state (NEXT, ACTIVE, the sticky error word). For a real process group it
lives in torch symmetric memory or a CUDA IPC allocation (``mhc_core.host.allocation``); the repr
shows the size and which.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..constants import HEADER_ENTRY_BYTES, LAMPORT_GENERATIONS, STAGE_STATE_WORDS
from .groups import RankGroup

TRANSPORT_ENV = "MHC_TRANSPORT"
TRANSPORTS = ("auto", "unicast", "multicast")


def requested_transport(requested: str | None) -> tuple[str, str]:
    """(the transport asked for: the argument, else ``MHC_TRANSPORT``, else "auto"; where it came
    from), validated."""
    source = "transport"
    if requested is None:
        requested, source = os.environ.get(TRANSPORT_ENV, "auto").strip() or "auto", TRANSPORT_ENV
    if requested not in TRANSPORTS:
        raise ValueError(f"{source}: expected one of {TRANSPORTS}, got {requested!r}")
    return requested, source


def resolve_transport(requested: str | None, group: RankGroup) -> str:
    """What the publish uses: ``"local"`` (tp = 1), ``"unicast"`` or ``"multicast"``.

    ``None`` reads ``MHC_TRANSPORT`` (default ``"auto"``). ``"auto"`` never selects
    multicast: NVLink multicast is opt-in only (``"multicast"``, explicitly).
    """
    requested, source = requested_transport(requested)
    if requested == "multicast":
        if group.kind != "process_group":
            raise ValueError(
                f"{source}: 'multicast' needs a torch process group with an NVLink multicast mapping; "
                f"this op's group is {group.kind!r} (tp = {group.tp})"
            )
        return "multicast"
    return "local" if group.tp == 1 else "unicast"


def mailbox_elements(tp: int, capacity: int, hidden: int) -> int:
    """BF16 elements of one rank's mailbox: the slots, then the header."""
    return LAMPORT_GENERATIONS * tp * (capacity * hidden + HEADER_ENTRY_BYTES // 2)


class LamportMailbox:
    """``[3, tp, capacity, hidden]`` BF16 slots (BF16 -0 = empty), the ``[3, tp]`` header of
    16-byte M entries after them (same sentinel), and int32 ``[NEXT, ACTIVE, ERROR, -]``.

    ``destinations`` is what the publish kernel stores through: every rank's
    mailbox base (unicast, own rank included) or the multicast base.
    """

    def __init__(
        self,
        group: RankGroup,
        *,
        capacity: int,
        hidden: int,
        device: torch.device,
        transport: str,
        startup: Any = None,
        allocation: str = "local",
    ) -> None:
        self.tp = group.tp
        self.capacity = capacity
        self.hidden = hidden
        self.transport = transport
        #: How a process group's mailboxes were allocated (``mhc_core.host.allocation``), else "local".
        self.allocation = allocation
        memory = group.allocate_mailbox(mailbox_elements(group.tp, capacity, hidden), device, startup, allocation)
        slots = LAMPORT_GENERATIONS * group.tp * capacity * hidden
        #: What keeps the allocation and the peers' mappings alive (released with the mailbox).
        self._owners = memory.owners
        self.memory = memory.local
        self.buffer = memory.local[:slots].view(LAMPORT_GENERATIONS, group.tp, capacity, hidden)
        self.header = memory.local[slots:].view(LAMPORT_GENERATIONS, group.tp, HEADER_ENTRY_BYTES // 2)
        # On the device so that CUDA-graph replays advance it.
        self.stage_state = torch.zeros(STAGE_STATE_WORDS, dtype=torch.int32, device=device)
        if transport == "multicast":
            if not memory.multicast or memory.multicast % 16:
                raise RuntimeError(
                    "transport='multicast': NVLink multicast mapping is unavailable for this group "
                    f"(symmetric memory multicast address {memory.multicast:#x})"
                )
            bases = [memory.multicast]
        else:
            bases = memory.peer_bases
        self.destinations = torch.tensor(bases, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return mailbox_elements(self.tp, self.capacity, self.hidden) * 2

    def __repr__(self) -> str:
        return (
            f"LamportMailbox({LAMPORT_GENERATIONS}x{self.tp}x{self.capacity}x{self.hidden} bf16, "
            f"{self.nbytes / 2**20:.1f} MiB per rank, transport={self.transport!r}, allocation={self.allocation!r})"
        )
