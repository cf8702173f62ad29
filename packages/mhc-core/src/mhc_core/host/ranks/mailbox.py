"""The Lamport mailbox of one rank: slots, stage state and where publishes go.

Memory: ``3 * tp * capacity * hidden * 2`` bytes per rank (three generations of
every rank's ``[capacity, hidden]`` BF16 contribution) plus a ``3 * tp * 16``-byte
header (each rank's M per generation, for the unequal-M check), and 16 bytes of
stage state (NEXT, ACTIVE, the sticky error word). For a real process group it
lives in torch symmetric memory or a CUDA IPC allocation (``mhc_core.host.ranks.allocation``); the repr
shows the size and which.

With the two-shot protocol (``mhc_core.protocols``) the same allocation holds two more regions after
the one-shot's: the reduce-scatter mailbox ``[3, tp, capacity, hidden / tp]`` (each rank's slice of
every rank's row) and the gather mailbox ``[3, 1, capacity, hidden]`` (the reduced row), each with
its header. The one-shot region then only holds the calls it serves (fewer than the crossover's
tokens): at tp 8 the whole is about ``2 / tp`` of a one-shot mailbox of the same capacity. One
allocation keeps the collective steps (symmetric memory, IPC handles) as they were.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ...constants import HEADER_ENTRY_BYTES, LAMPORT_GENERATIONS, STAGE_STATE_WORDS
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


@dataclass(frozen=True)
class MailboxLayout:
    """Where each protocol's region lies in one rank's allocation (BF16 elements): the one-shot's
    ``[3, tp, one_shot_capacity, hidden]``, then, with a two-shot capacity, the reduce-scatter
    ``[3, tp, two_shot_capacity, hidden / tp]`` and the gather ``[3, 1, two_shot_capacity, hidden]``."""

    tp: int
    hidden: int
    one_shot_capacity: int
    two_shot_capacity: int = 0

    @property
    def scatter_offset(self) -> int:
        return mailbox_elements(self.tp, self.one_shot_capacity, self.hidden)

    @property
    def gather_offset(self) -> int:
        if not self.two_shot_capacity:
            return self.scatter_offset
        return self.scatter_offset + mailbox_elements(self.tp, self.two_shot_capacity, self.hidden // self.tp)

    @property
    def elements(self) -> int:
        if not self.two_shot_capacity:
            return self.scatter_offset
        return self.gather_offset + mailbox_elements(1, self.two_shot_capacity, self.hidden)


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
        two_shot_capacity: int = 0,
    ) -> None:
        self.tp = group.tp
        #: The one-shot region's token capacity (with a two-shot: only the calls below its crossover).
        self.capacity = capacity
        self.hidden = hidden
        self.transport = transport
        #: How a process group's mailboxes were allocated (``mhc_core.host.ranks.allocation``), else "local".
        self.allocation = allocation
        self.layout = MailboxLayout(group.tp, hidden, capacity, two_shot_capacity)
        memory = group.allocate_mailbox(self.layout.elements, device, startup, allocation)
        slots = LAMPORT_GENERATIONS * group.tp * capacity * hidden
        #: What keeps the allocation and the peers' mappings alive (released with the mailbox).
        self._owners = memory.owners
        self.memory = memory.local
        self.buffer = memory.local[:slots].view(LAMPORT_GENERATIONS, group.tp, capacity, hidden)
        self.header = memory.local[slots : self.layout.scatter_offset].view(
            LAMPORT_GENERATIONS, group.tp, HEADER_ENTRY_BYTES // 2
        )
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
        #: The two-shot's regions (None without one): this rank's reduce-scatter and gather mailboxes
        #: (flat, slots then header), and every rank's base of each (what its stores go through).
        self.scatter_buffer: torch.Tensor | None = None
        self.gather_buffer: torch.Tensor | None = None
        self.scatter_destinations: torch.Tensor | None = None
        self.gather_destinations: torch.Tensor | None = None
        if two_shot_capacity:
            layout = self.layout
            self.scatter_buffer = memory.local[layout.scatter_offset : layout.gather_offset]
            self.gather_buffer = memory.local[layout.gather_offset : layout.elements]
            self.scatter_destinations = torch.tensor(
                [base + 2 * layout.scatter_offset for base in memory.peer_bases], dtype=torch.int64, device=device
            )
            self.gather_destinations = torch.tensor(
                [base + 2 * layout.gather_offset for base in memory.peer_bases], dtype=torch.int64, device=device
            )

    @property
    def two_shot_capacity(self) -> int:
        return self.layout.two_shot_capacity

    @property
    def nbytes(self) -> int:
        return self.layout.elements * 2

    def __repr__(self) -> str:
        two_shot = self.layout.two_shot_capacity
        regions = f"{LAMPORT_GENERATIONS}x{self.tp}x{self.capacity}x{self.hidden} bf16"
        if two_shot:
            regions += f" + two-shot {two_shot} tokens"
        return (
            f"LamportMailbox({regions}, {self.nbytes / 2**20:.1f} MiB per rank, transport={self.transport!r}, "
            f"allocation={self.allocation!r})"
        )
