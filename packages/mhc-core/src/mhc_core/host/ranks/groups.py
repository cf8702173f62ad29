"""TP groups an op can run over: none (tp = 1), a torch process group, or loopback ranks.

An op only needs four things from its group: ``tp`` and ``rank``, a mailbox
allocated collectively (every rank's base address known to every rank), and a
construction step that warms every kernel up without any kernel waiting on a
publish that has not been launched yet.

Loopback: ``LoopbackGroup(world_size, device)`` runs ``world_size`` virtual ranks in
one process on one GPU through exactly the unicast kernels. ``group[r]`` is rank
``r``'s handle, accepted wherever a process group is. The ``k``-th op built on each
handle forms one collective instance: the first rank to build allocates every
rank's mailbox, and the last one warms all of them up together (every rank's
publish, then every rank's collective). ``LoopbackGroup.run`` drives calls the
same way, so no token count can deadlock.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from .allocation import ALLOCATORS, MailboxMemory, fill_sentinel

SUPPORTED_TP = (1, 2, 4, 8)


class GroupMember(Protocol):
    """What a group needs of an op (``mhc_core.host.op.GroupMember`` is one): its device, and the
    calls that launch every kernel of it once (each a ``Plan``: ``publish()``, ``collect(bool)``)."""

    device: torch.device

    def warmup_rounds(self) -> Sequence[Any]: ...


def _sentinel_filled(elements: int, device: torch.device) -> torch.Tensor:
    return fill_sentinel(torch.empty(elements, dtype=torch.bfloat16, device=device))


def warm_up(ops: Sequence[GroupMember]) -> None:
    """Launch every kernel of ``ops`` once: each round, every rank's publish, then every collective.

    Loading a module waits behind running kernels, so a first launch behind a
    spinning collective can deadlock; after this every module is loaded.
    """
    rounds = [op.warmup_rounds() for op in ops]
    for step in range(len(rounds[0])):
        for steps in rounds:
            steps[step].publish()
        for steps in rounds:
            exchange = getattr(steps[step], "exchange", None)  # a two-shot's reduce (``Plan.exchange``)
            if exchange is not None:
                exchange()
        for index, steps in enumerate(rounds):
            steps[step].collect(index == 0)
    torch.cuda.synchronize(ops[0].device)


class RankGroup:
    """What an op needs from its TP group."""

    kind = "none"
    tp = 1
    rank = 0

    def allocate_mailbox(self, elements: int, device: torch.device, startup: Any, allocation: str) -> MailboxMemory:
        """``elements`` BF16 of sentinel-filled mailbox memory on every rank (collective; ``allocation``
        picks how for a process group, ``mhc_core.host.ranks.allocation``)."""
        raise NotImplementedError

    def exchange_ballots(self, ballot: Any, device: Any = None) -> list[Any]:
        """Every rank's ballot of one startup vote (``mhc_core.host.ranks.startup``); here only this rank's."""
        return [ballot]

    def complete_construction(self, op: GroupMember) -> None:
        raise NotImplementedError

    def missing_peers(self, op: GroupMember) -> list[int]:
        """Ranks whose op of the same instance does not exist yet (loopback only)."""
        return []

    def barrier(self) -> None:
        """Every rank reaches this point (a process group's ``dist.barrier``; nothing elsewhere)."""


class SoloGroup(RankGroup):
    """tp = 1: no process group; the mailbox is a local buffer."""

    def allocate_mailbox(self, elements: int, device: torch.device, startup: Any, allocation: str) -> MailboxMemory:
        local = _sentinel_filled(elements, device)
        return MailboxMemory(local, [local.data_ptr()])

    def complete_construction(self, op: GroupMember) -> None:
        warm_up([op])


class ProcessGroupRanks(RankGroup):
    """A real process group (any backend): mailboxes from ``mhc_core.host.ranks.allocation`` (torch symmetric
    memory or CUDA IPC), startup votes and barriers through the group."""

    kind = "process_group"

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        self.tp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Object collectives of a NCCL group stage through the current CUDA device.
        self._on_device = "nccl" in str(dist.get_backend(group)).lower()

    def allocate_mailbox(self, elements: int, device: torch.device, startup: Any, allocation: str) -> MailboxMemory:
        return ALLOCATORS[allocation].allocate(self, startup, elements, device)

    def exchange_ballots(self, ballot: Any, device: Any = None) -> list[Any]:
        import torch.distributed as dist

        ballots: list[Any] = [None] * self.tp
        with torch.cuda.device(normalize_device(device or "cuda")) if self._on_device else _nothing():
            dist.all_gather_object(ballots, ballot, group=self.group)
        return ballots

    def complete_construction(self, op: GroupMember) -> None:
        warm_up([op])  # the startup's "ready" vote follows: every rank's warm-up is done after it

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


class LoopbackRank(RankGroup):
    """Rank ``rank`` of a ``LoopbackGroup``."""

    kind = "loopback"

    def __init__(self, group: LoopbackGroup, rank: int) -> None:
        self.group = group
        self.tp = group.world_size
        self.rank = rank
        self._allocations = 0
        self._constructions = 0
        # Each op built on this rank -> the instance (its k-th construction) it belongs to.
        self._instance_of: weakref.WeakKeyDictionary[GroupMember, int] = weakref.WeakKeyDictionary()

    def allocate_mailbox(self, elements: int, device: torch.device, startup: Any, allocation: str) -> MailboxMemory:
        index = self._allocations
        self._allocations += 1
        return self.group._mailbox(index, self.rank, elements, device)

    def exchange_ballots(self, ballot: Any, device: Any = None) -> list[Any]:
        """The ballots of this instance's ranks built so far (the op's next mailbox names the
        instance): the first rank's ``config`` and ``kernels`` are what later ranks must match."""
        if ballot.stage not in ("config", "kernels"):
            return [ballot]
        ballots = self.group._ballots.setdefault((self._allocations, ballot.stage), {})
        earlier = [ballots[rank] for rank in sorted(ballots) if rank != self.rank]
        if ballot.error is None:
            ballots[self.rank] = ballot
        return [*earlier, ballot]

    def complete_construction(self, op: GroupMember) -> None:
        index = self._constructions
        self._constructions += 1
        self._instance_of[op] = index
        self.group._join(index, self.rank, op)

    def missing_peers(self, op: GroupMember) -> list[int]:
        joined = self.group._instances.get(self._instance_of.get(op, -1), {})
        return [rank for rank in range(self.tp) if rank not in joined]

    def exchange_pending(self, op: Any) -> None:
        """Before a ``collect()`` on a loopback rank: if ``op``'s pending publish is a two-shot whose
        reduce has not run, every rank's reduce of the instance, once each, in rank order (each needs
        every rank's publish, and each rank's boundary every rank's reduce). Every rank must have
        published the same M first: else a reduce would wait for a publish queued behind it, so this
        raises instead. Every rank's lock is held throughout, taken in the process-wide order
        (``lock_order``), so two threads collecting two ranks cannot wait for each other. A collect
        with nothing pending is left to the collect to refuse."""
        ranks = self.group._instances.get(self._instance_of.get(op, -1), {})

        def run() -> list[Any]:
            op._check_usable()  # a closed or poisoned op raises as its collect would, launching nothing
            m = op._pending_m
            if m is None or op._exchanged or not op._loopback_two_shot(m):
                return []
            pending = {rank: peer._pending_m for rank, peer in sorted(ranks.items())}
            waiting = [rank for rank, peer_m in pending.items() if peer_m != m]
            if len(ranks) != self.tp or waiting:
                raise RuntimeError(
                    f"collect(): a loopback two-shot collect (M = {m}) needs every rank's publish() first; "
                    f"ranks {waiting or self.missing_peers(op)} have {[pending.get(r) for r in waiting]} pending"
                )
            for rank in sorted(ranks):
                if not ranks[rank]._exchanged:
                    ranks[rank]._run_exchange(m)
            return []

        _holding_locks([op, *ranks.values()], run)

    def __repr__(self) -> str:
        return f"LoopbackRank({self.rank} of {self.tp})"


class LoopbackGroup:
    """``world_size`` virtual TP ranks on one GPU (see the module docstring)."""

    def __init__(self, world_size: int, device: torch.device | str | int = "cuda") -> None:
        if isinstance(world_size, bool) or world_size not in SUPPORTED_TP:
            raise ValueError(f"world_size: expected one of {SUPPORTED_TP}, got {world_size!r}")
        self.world_size = world_size
        self.device = normalize_device(device)
        self.ranks = tuple(LoopbackRank(self, rank) for rank in range(world_size))
        self._mailboxes: dict[int, list[torch.Tensor]] = {}
        self._instances: dict[int, dict[int, GroupMember]] = {}
        #: (instance, stage) -> rank -> startup ballot (``LoopbackRank.exchange_ballots``).
        self._ballots: dict[tuple[int, str], dict[int, Any]] = {}

    def __getitem__(self, rank: int) -> LoopbackRank:
        return self.ranks[rank]

    def __iter__(self):
        return iter(self.ranks)

    def __len__(self) -> int:
        return self.world_size

    def build(self, factory: Callable[[LoopbackRank], GroupMember]) -> list[GroupMember]:
        """One op per rank, ``factory(group[r])``; the last one warms them all up."""
        return [factory(rank) for rank in self.ranks]

    def run(
        self,
        ops: Sequence[GroupMember],
        method: str,
        args: Sequence[Sequence[Any]],
        kwargs: Sequence[dict[str, Any]] | None = None,
    ) -> list[Any]:
        """``run_ranks`` over this group's ops (one per rank, in rank order)."""
        if len(ops) != self.world_size:
            raise ValueError(f"ops: expected {self.world_size} ops, one per rank, got {len(ops)}")
        return run_ranks(ops, method, args, kwargs)

    def _mailbox(self, index: int, rank: int, elements: int, device: torch.device) -> MailboxMemory:
        if device != self.device:
            raise ValueError(f"device: expected the loopback group's device {self.device}, got {device}")
        buffers = self._mailboxes.get(index)
        if buffers is None:
            buffers = [_sentinel_filled(elements, device) for _ in range(self.world_size)]
            self._mailboxes[index] = buffers
        elif buffers[0].numel() != elements:
            raise ValueError(
                f"loopback op #{index}: rank {rank} asks for a mailbox of {elements} elements, "
                f"but rank 0's op of that instance has {buffers[0].numel()}: build the same op on every rank"
            )
        return MailboxMemory(buffers[rank], [buffer.data_ptr() for buffer in buffers])

    def _join(self, index: int, rank: int, op: GroupMember) -> None:
        instance = self._instances.setdefault(index, {})
        instance[rank] = op
        if len(instance) == self.world_size:
            warm_up([instance[r] for r in range(self.world_size)])


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def run_ranks(
    ops: Sequence[GroupMember],
    method: str,
    args: Sequence[Sequence[Any]],
    kwargs: Sequence[dict[str, Any]] | None = None,
) -> list[Any]:
    """Run ``method`` ("call" or "finalize") on ops that form one collective instance.

    Validates every rank's arguments first (nothing launches on bad input), then
    enqueues every rank's publish, then (two-shot) every rank's reduce, then every rank's
    collective, on the current stream: no kernel can wait on one enqueued behind it, whatever M.
    ``args[r]`` / ``kwargs[r]`` are rank ``r``'s arguments; returns each rank's outputs.
    Works for a single tp = 1 op too. Holds every op's lock for the whole run, taken in one order
    for the whole process (the ops' creation order, whatever the order of ``ops``): another
    thread's run over the same ops comes before or after it, whole, and two runs that list the same
    ops in different orders cannot deadlock.
    """
    if len(args) != len(ops) or (kwargs is not None and len(kwargs) != len(ops)):
        raise ValueError(f"args, kwargs: expected one entry per op ({len(ops)})")
    kwargs = kwargs or [{} for _ in ops]

    def run() -> list[Any]:
        plans = [op.plan(method, *a, **k) for op, a, k in zip(ops, args, kwargs, strict=True)]
        for plan in plans:
            plan.publish()
        for plan in plans:  # a two-shot's reduce: after every publish, before any collective
            if plan.exchange is not None:
                plan.exchange()
        # Only the first collective directly follows a publish (PDL prefetch is safe).
        return [plan.collect(index == 0) for index, plan in enumerate(plans)]

    return _holding_locks(ops, run)


def _holding_locks(ops: Sequence[Any], run: Callable[[], list[Any]]) -> list[Any]:
    """``run()`` holding every op's lock, taken by the ops' creation serial (``lock_order``): one
    global order, so two threads locking the same ops never wait for each other in a cycle."""
    unique = {id(op): op for op in ops}
    return _locked(sorted(unique.values(), key=lock_order), run)


def _locked(ops: Sequence[Any], run: Callable[[], list[Any]]) -> list[Any]:
    if not ops:
        return run()
    with ops[0]._lock:
        return _locked(ops[1:], run)


def lock_order(op: Any) -> int:
    """The position of ``op``'s lock in the process-wide order (its creation serial)."""
    return op._lock_serial


def normalize_device(device: torch.device | str | int) -> torch.device:
    """A CUDA device with an explicit index (``"cuda"`` means the current one). Resolving the current
    device is the first CUDA query: where it cannot be made (a CPU-only torch, no visible GPU) a
    RuntimeError says which (``mhc_core.host.binaries.support``) instead of torch's AssertionError."""
    from ..binaries.support import as_device, require_device

    device = as_device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    if device.index is None:
        require_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_group(group: Any) -> RankGroup:
    """``None`` (tp = 1), a torch process group, or a loopback rank handle."""
    if group is None:
        return SoloGroup()
    if isinstance(group, RankGroup):
        return group
    if isinstance(group, LoopbackGroup):
        raise TypeError("group: expected one rank of a LoopbackGroup (group[r]), got the whole LoopbackGroup")
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return ProcessGroupRanks(group)
    raise TypeError(
        f"group: expected None, a torch.distributed.ProcessGroup or a LoopbackGroup rank, got {type(group).__name__}"
    )
