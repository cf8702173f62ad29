"""The fallback signal: can the fused ops run on this TP group? An engine asks before it builds them,
logs the reason when the answer is no, and takes NCCL's all-reduce and the unfused boundary instead
(docs/engine-contract.md, "Falling back"), as vLLM's custom all-reduce turns itself off.

``check_fused_support(group, device, multicast=...)`` checks, for every rank of ``group``:

* the device: a CUDA build of torch, a visible GPU, an arch the kernels target
  (``mhc_core.host.binaries.support``);
* tp: the group's size is one the ops support (``SUPPORTED_TP``);
* one node: every rank on the same host (the mailbox is mapped through CUDA IPC or symmetric
  memory, neither of which crosses nodes);
* peer access between every two distinct GPUs of the group (ranks sharing a GPU need none);
* the same arch on every rank (one kernel set per op);
* NVLink multicast, where ``multicast=True`` asks for it: supported by every rank's GPU and
  driver, not disabled (``TORCH_SYMM_MEM_DISABLE_MULTICAST``), and no two ranks on one GPU.

It is collective over a process group: every rank calls it, each rank's facts are exchanged once
(``all_gather_object``), and every rank computes the same answer from all of them, so the ranks
fall back together. It never raises for what it checks; it builds nothing and allocates nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..binaries.support import DeviceLike, as_device, device_problem
from .groups import SUPPORTED_TP, LoopbackGroup, LoopbackRank


@dataclass(frozen=True)
class FusedSupport:
    """The answer: ``ok`` (also the truth value) and, when not, every reason, each naming the rank(s)."""

    ok: bool
    tp: int
    reasons: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok

    @property
    def reason(self) -> str:
        """The reasons in one line (what to log); ``"supported"`` when ``ok``."""
        return "; ".join(self.reasons) if self.reasons else "supported"


@dataclass(frozen=True)
class RankFacts:
    """What one rank knows about itself, exchanged once: picklable plain data."""

    rank: int
    host: str
    problem: str | None  # support.device_problem of its device
    gpu: str | None  # its GPU's UUID (None: no usable GPU)
    arch: tuple[int, int] | None
    #: (UUID a, UUID b) -> whether a can access b's memory, for every two GPUs this rank sees.
    peer_access: dict[tuple[str, str], bool] = field(default_factory=dict)
    #: Why NVLink multicast is unavailable on its GPU (None: available, or not asked).
    multicast_problem: str | None = None


def host_id() -> str:
    """This host: its name and boot id (two containers may share a name, never a boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as stream:
            boot = stream.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def multicast_problem(index: int) -> str | None:
    """Why NVLink multicast cannot be mapped on GPU ``index`` (None: it can)."""
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0") not in ("", "0"):
        return "NVLink multicast is disabled (TORCH_SYMM_MEM_DISABLE_MULTICAST=1)"
    try:
        from torch._C._distributed_c10d import _SymmetricMemory

        supported = _SymmetricMemory.has_multicast_support(torch._C._autograd.DeviceType.CUDA, index)
    except (ImportError, AttributeError, RuntimeError) as error:
        return f"torch {torch.__version__} cannot tell whether NVLink multicast works here ({error})"
    return None if supported else f"GPU {index} or its driver has no NVLink multicast support"


def local_facts(rank: int, device: DeviceLike | None, multicast: bool) -> RankFacts:
    """This rank's facts (its device's problem, GPU, arch, peer access among the GPUs it sees)."""
    problem = device_problem(device)
    if problem is not None:
        return RankFacts(rank, host_id(), problem, None, None)
    index = as_device(device).index
    index = torch.cuda.current_device() if index is None else index
    visible = {i: _uuid(i) for i in range(torch.cuda.device_count())}
    access = {
        (visible[a], visible[b]): bool(torch.cuda.can_device_access_peer(a, b))
        for a in visible
        for b in visible
        if visible[a] != visible[b]
    }
    capability = tuple(torch.cuda.get_device_capability(index))
    arch = (int(capability[0]), int(capability[1]))
    return RankFacts(
        rank, host_id(), None, visible[index], arch, access, multicast_problem(index) if multicast else None
    )


def _group_shape(group: Any) -> tuple[int, int]:
    """(tp, this rank) of ``group``: None (tp 1), a ProcessGroup, or a loopback rank or group."""
    if group is None:
        return 1, 0
    if isinstance(group, LoopbackRank):
        return group.tp, group.rank
    if isinstance(group, LoopbackGroup):
        return group.world_size, 0
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group), dist.get_rank(group)
    raise TypeError(
        f"group: expected None, a torch.distributed.ProcessGroup or a LoopbackGroup (or one of its ranks), "
        f"got {type(group).__name__}"
    )


def exchange(group: Any, facts: RankFacts, tp: int) -> list[RankFacts]:
    """Every rank's facts, in rank order (collective over a process group). Loopback ranks share this
    process and its GPU: this rank's facts stand for all of them."""
    import torch.distributed as dist

    if group is None or isinstance(group, (LoopbackRank, LoopbackGroup)):
        return [RankFacts(rank, facts.host, facts.problem, facts.gpu, facts.arch, facts.peer_access,
                          facts.multicast_problem) for rank in range(tp)]  # fmt: skip
    gathered: list[Any] = [None] * tp
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    if nccl and facts.problem is None:  # NCCL stages object collectives through the current device
        with torch.cuda.device(torch.cuda.current_device()):
            dist.all_gather_object(gathered, facts, group=group)
    else:
        dist.all_gather_object(gathered, facts, group=group)
    return gathered


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def verdict(tp: int, ranks: Sequence[RankFacts], multicast: bool) -> FusedSupport:
    """The answer every rank computes from every rank's facts (pure: what the CPU tests drive)."""
    reasons = []
    if tp not in SUPPORTED_TP:
        reasons.append(f"tp: the fused ops support tp in {SUPPORTED_TP}; this group has tp = {tp}")
    for facts in ranks:
        if facts.problem is not None:
            reasons.append(f"rank {facts.rank}: {facts.problem}")
    hosts: dict[str, list[int]] = {}
    for facts in ranks:
        hosts.setdefault(facts.host, []).append(facts.rank)
    if len(hosts) > 1:
        where = "; ".join(f"{_ranks(members)} on {host.split('/')[0]}" for host, members in hosts.items())
        reasons.append(f"one node: the group spans {len(hosts)} hosts ({where}); the mailbox cannot cross nodes")
    usable = [facts for facts in ranks if facts.gpu is not None]
    archs = {facts.arch for facts in usable}
    if len(archs) > 1:
        described = ", ".join(f"rank {facts.rank} sm_{facts.arch[0]}{facts.arch[1]}" for facts in usable if facts.arch)
        reasons.append(f"arch: the group's GPUs differ ({described}); one op runs one kernel set")
    if len(hosts) == 1:
        reasons += _peer_reasons(usable)
    if multicast:
        reasons += _multicast_reasons(tp, usable)
    return FusedSupport(not reasons, tp, tuple(reasons))


def _peer_reasons(usable: Sequence[RankFacts]) -> list[str]:
    """Every two ranks on distinct GPUs need peer access, both ways, as some rank of the group saw it."""
    seen: dict[tuple[str, str], bool] = {}
    for facts in usable:
        for pair, allowed in facts.peer_access.items():
            seen[pair] = seen.get(pair, True) and allowed
    missing = []
    for first in usable:
        for second in usable:
            if first.rank < second.rank and first.gpu != second.gpu:
                pairs = [(first.gpu, second.gpu), (second.gpu, first.gpu)]
                if any(seen.get(pair) is False for pair in pairs):  # type: ignore[arg-type]
                    missing.append(f"{first.rank}-{second.rank}")
    if not missing:
        return []
    return [f"peer access: no CUDA peer access between the GPUs of ranks {', '.join(missing)} (no NVLink or P2P)"]


def _multicast_reasons(tp: int, usable: Sequence[RankFacts]) -> list[str]:
    reasons = []
    gpus: dict[str | None, list[int]] = {}
    for facts in usable:
        gpus.setdefault(facts.gpu, []).append(facts.rank)
    shared = [members for members in gpus.values() if len(members) > 1]
    if tp > 1 and shared:
        reasons.append(
            f"multicast: {'; '.join(_ranks(members) for members in shared)} share a GPU; NVLink multicast "
            "needs one GPU per rank (symmetric memory)"
        )
    for facts in usable:
        if facts.multicast_problem is not None:
            reasons.append(f"multicast: rank {facts.rank}: {facts.multicast_problem}")
    return reasons


def check_fused_support(
    group: Any = None, device: DeviceLike | None = None, *, multicast: bool = False
) -> FusedSupport:
    """Whether the fused ops can run on ``group`` (None: tp 1) with this rank's ``device`` (default:
    the current CUDA device), and if not, why (see the module docstring). Collective over a process
    group: call it on every rank, before building any op. ``multicast=True``: also whether
    ``transport="multicast"`` can be used."""
    tp, rank = _group_shape(group)
    facts = local_facts(rank, device, multicast)
    return verdict(tp, exchange(group, facts, tp), multicast)
