"""The standalone Lamport all-reduce: publish + plain collective for any ``[M, hidden]`` BF16 tensor.

``LamportAllReduce`` is the op (any group, any transport, plain or MoE-finalize
input); ``lamport_all_reduce`` is a function over it that keeps one op per (group, device,
hidden, top_k) and replaces it, collectively, when a larger M or other settings arrive
(``close_lamport_all_reduce`` closes them). The result is the BF16 rounding of the FP32 sum
over ranks in the order ``mhc_core.reference.tp_sum`` gives, bit-identical on every rank.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..device.configs import COLLECTIVE_KERNEL, TRIGGER_AFTER_STORES, CollectiveConfig
from ..protocols import ONE_SHOT
from .binaries.compiler import KernelSpec
from .calls.moe import MoEOutput
from .calls.programs import Launch, Pointer, Source
from .calls.rules import IN_PLACE_LAYER_INPUT, M, Rule, TensorRule, tensor
from .calls.spin import TokenCountError, resolve_timeout_ms
from .calls.validation import check_int
from .lifetime import _CAPTURED
from .op import MAX_NUM_TOKENS, LamportOp
from .ranks.allocation import requested_allocation
from .ranks.mailbox import requested_transport
from .ranks.startup import collective


class LamportAllReduce(LamportOp):
    """Lamport one-shot all-reduce of ``[M, hidden]`` BF16 partials over ``group``.

    Construction is collective over ``group`` (None: tp = 1; a process group; or
    a ``LoopbackGroup`` rank). ``lanes`` rank lanes share each fragment (1: ranks
    summed one after another).
    """

    #: The plain collective reads only the mailbox: a tp = 1 call still publishes.
    reads_x = False

    @collective
    def __init__(
        self,
        *,
        hidden_size: int,
        max_num_tokens: int,
        device: torch.device | str | int,
        group: Any = None,
        transport: str | None = None,
        top_k: int = 0,
        threads: int = 128,
        lanes: int = 1,
        spin_timeout_ms: float | None = None,
        check_routes: bool = False,
        mailbox_allocation: str | None = None,
    ) -> None:
        check_int("threads", threads)  # their ranges: CollectiveConfig's, before anything is built
        check_int("lanes", lanes)
        super().__init__(
            hidden_size=hidden_size,
            max_num_tokens=max_num_tokens,
            device=device,
            group=group,
            transport=transport,
            top_k=top_k,
            publish_trigger=TRIGGER_AFTER_STORES,
            spin_timeout_ms=spin_timeout_ms,
            check_routes=check_routes,
            mailbox_allocation=mailbox_allocation,
            # The plain all-reduce stays one-shot: its two-shot would be the boundary's reduce and a
            # plain gather, not built yet (mhc_core.protocols).
            protocol=ONE_SHOT,
        )
        self.lanes = lanes
        config = CollectiveConfig(hidden=hidden_size, tp=self.tp, threads=threads, lanes=lanes)
        self._build_publishes()
        self._collective_kernel = self._compile(KernelSpec(COLLECTIVE_KERNEL, config))
        self._setup()

    def _collect_rules(self) -> tuple[Rule, ...]:
        return ()

    def _output_rules(self) -> tuple[TensorRule, ...]:
        # In place: out may be x (or the MoE shared output); the collective writes after the publish read it.
        return (tensor("out", (M, self.hidden_size), dtype=torch.bfloat16, aliases=IN_PLACE_LAYER_INPUT),)

    def _collect_launches(self, *, direct: bool, prefetch: Source, protocol: str = ONE_SHOT) -> list[Launch]:
        kernel = self._collective_kernel
        return [Launch([kernel.function], kernel.signature, dict(self._collective_fixed(), out=Pointer("out")))]

    def _allocate(self, like: Any, values: tuple, m: int) -> tuple[torch.Tensor, ...]:
        return (self._hidden_like(like, m),)

    def _returns(self, outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return outputs[0]

    def _warmup_collects(self) -> list[tuple[tuple, int]]:
        return [((), -1)]

    def _plan_values(self, method: str, *args: Any, **kwargs: Any) -> tuple[object, tuple, Any]:
        if method != "call":
            raise ValueError(f"method: LamportAllReduce takes 'call' (MoE input as a MoEOutput), got {method!r}")
        (x,) = args
        return x, (), kwargs.pop("out", None)

    def __call__(self, x: torch.Tensor | MoEOutput, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The all-reduced ``[M, hidden]`` BF16 sum of every rank's ``x`` (or finalized MoE output)."""
        return self._returns(self._call(x, (), out))

    def collect(self, *, out: torch.Tensor | None = None, after_publish: bool = False) -> torch.Tensor:
        """Phase two: the all-reduced result of the pending ``publish``."""
        return self._collect_pending((), out, after_publish)  # already the one tensor (_returns)

    def __repr__(self) -> str:
        return f"LamportAllReduce(lanes={self.lanes}, {self._describe()})"


@dataclass
class _Cached:
    """An op ``lamport_all_reduce`` keeps, and the settings it was built with."""

    op: LamportAllReduce
    #: (transport, spin bound, mailbox allocation) as requested (environment variables read).
    settings: tuple[Any, ...]
    #: Calls using the op right now: a replacement waits for none before closing it (``_CACHE``).
    users: int = 0

    @property
    def limit(self) -> int:
        """The largest M a call may pass: the op holds one row more, for the growth signal's M
        (``_signal_growth``), a count no call on this op can have."""
        return self.op.capacity - 1


#: group -> (device, hidden, top_k) -> the op. Keyed by the group object itself (None: tp = 1), never by
#: its ``id()``, which Python gives a new object once the old one is gone. A weak key would not help:
#: each op holds its group. A group destroyed with ``torch.distributed.destroy_process_group`` loses
#: its ops at the next build (dropped, not closed: a destroyed group runs no collective).
_OPS: dict[Any, dict[tuple[Any, ...], _Cached]] = {}
#: Guards ``_OPS``, ``_BUILDS`` and every entry's ``users``; notified when an entry's last user leaves.
_CACHE = threading.Condition()
#: group -> the lock its replacements hold (each is collective over that group; another group's
#: calls never wait for it).
_BUILDS: dict[Any, threading.Lock] = {}


def lamport_all_reduce(
    x: torch.Tensor | MoEOutput,
    *,
    group: Any = None,
    transport: str | None = None,
    max_num_tokens: int | None = None,
    out: torch.Tensor | None = None,
    spin_timeout_ms: float | None = None,
    mailbox_allocation: str | None = None,
) -> torch.Tensor:
    """All-reduce ``x`` (``[M, hidden]`` BF16) over ``group`` with the Lamport protocol.

    Keeps one ``LamportAllReduce`` per (group, device, hidden, top_k). The first call builds it
    (collectively); a call with a larger M than it holds, or with another transport, spin bound or
    mailbox allocation (arguments, else their environment variables), replaces it: the old op is
    closed, then the new one built, both collective over the group. So every rank must make the
    same calls, with the same arguments. ``close_lamport_all_reduce(group)`` closes a group's ops
    (on every rank: before destroying the group, or to rebuild after a timeout). For loopback
    ranks use ``LamportAllReduce`` with ``LoopbackGroup.run`` (one process holds every rank).

    Growth is agreed before any collective step (with the spin bound on, the default): a rank whose
    M is above the op's first takes part in the op's call with a count no call can have, so every
    rank's collective compares; ranks that did not grow raise ``TokenCountError`` naming it (at
    their next call or ``check()``), and it raises ``TokenCountError`` naming them. Ranks that all
    grow then compare the new size, and raise ``TokenCountError`` naming the ranks if it differs,
    before the old op is closed. A CUDA graph captured on a replaced op replays NaN (the op is
    closed): a replacement warns about it; capture again on the new op.

    Threads: the cache is guarded; a replacement waits for the calls using the old op to return
    before closing it, and one group's replacement never holds up another group's calls.
    """
    from .ranks.groups import LoopbackRank

    if isinstance(group, LoopbackRank):
        raise TypeError(
            "group: lamport_all_reduce takes None or a process group; drive loopback ranks with "
            "LamportAllReduce and LoopbackGroup.run"
        )
    shared = x.shared_output if isinstance(x, MoEOutput) else x
    if not isinstance(shared, torch.Tensor) or shared.dim() != 2:
        raise TypeError("x: expected a [M, hidden] torch.Tensor or a MoEOutput")
    if max_num_tokens is not None:
        check_int("max_num_tokens", max_num_tokens, minimum=1, maximum=MAX_NUM_TOKENS)
    settings = _requested_settings(transport, spin_timeout_ms, mailbox_allocation)
    m, hidden = shared.shape
    top_k = x.expert_weights.shape[1] if isinstance(x, MoEOutput) and x.expert_weights.dim() == 2 else 0
    slot = (shared.device, hidden, top_k)
    cached = _take(group, slot, settings, max(m, max_num_tokens or 0), m)
    try:
        return cached.op(x, out=out)
    finally:
        with _CACHE:
            cached.users -= 1
            if not cached.users:
                _CACHE.notify_all()


def _requested_settings(transport: str | None, spin_timeout_ms: float | None, allocation: str | None) -> tuple:
    """What an op is built with beyond its shape, as requested (validated; environment read)."""
    return requested_transport(transport)[0], resolve_timeout_ms(spin_timeout_ms), requested_allocation(allocation)


def _fits(cached: _Cached | None, settings: tuple[Any, ...], capacity: int) -> bool:
    return cached is not None and cached.settings == settings and cached.limit >= capacity


def _claim(group: Any, slot: tuple[Any, ...], settings: tuple[Any, ...], capacity: int) -> tuple[Any, bool]:
    """(the slot's op or None, whether it fits and is now counted as used); the caller holds ``_CACHE``."""
    cached = _OPS.get(group, {}).get(slot)
    if not _fits(cached, settings, capacity):
        return cached, False
    cached.users += 1
    return cached, True


def _take(group: Any, slot: tuple[Any, ...], settings: tuple[Any, ...], capacity: int, m: int) -> _Cached:
    """The slot's op, counted as used (the caller gives it back), replaced first if it does not fit."""
    with _CACHE:
        cached, claimed = _claim(group, slot, settings, capacity)
        if claimed:
            return cached
        build = _BUILDS.setdefault(group, threading.Lock())
    with build:  # one replacement per group at a time; a thread that waited here uses its op
        with _CACHE:
            cached, claimed = _claim(group, slot, settings, capacity)
            if claimed:
                return cached
        cached = _replace(group, slot, cached, settings, capacity, m)
        with _CACHE:
            cached.users += 1
        return cached


def _replace(
    group: Any, slot: tuple[Any, ...], old: _Cached | None, settings: tuple[Any, ...], capacity: int, m: int
) -> _Cached:
    """Agree on the growth, close ``old`` once no call uses it (collectively), then build the slot's
    op (collectively) with ``settings``."""
    if old is not None:
        capacity = max(capacity, old.limit)
        if capacity > old.limit:
            _signal_growth(old, m)
            _agree_on_growth(old, capacity)
        with _CACHE:
            _OPS.get(group, {}).pop(slot, None)  # gone from the cache even if a rank fails to close it or to build
            while old.users:  # another thread's call still uses it
                _CACHE.wait()
        captured = id(old.op) in _CAPTURED
        old.op.close()
        if captured:
            warnings.warn(
                f"lamport_all_reduce replaced its op for (device, hidden, top_k) = {slot} (max_num_tokens "
                f"{old.limit} -> {capacity}): CUDA graphs captured on the old op now replay NaN (it was closed); "
                "capture them again",
                RuntimeWarning,
                stacklevel=4,
            )
    device, hidden, top_k = slot
    transport, spin_timeout_ms, allocation = settings
    op = LamportAllReduce(
        hidden_size=hidden, max_num_tokens=min(capacity + 1, MAX_NUM_TOKENS), device=device, group=group,
        transport=transport, top_k=top_k, spin_timeout_ms=spin_timeout_ms or 0, mailbox_allocation=allocation,
    )  # fmt: skip
    cached = _Cached(op, settings)
    with _CACHE:
        _forget_destroyed_groups()
        _OPS.setdefault(group, {})[slot] = cached
    return cached


def _signal_growth(old: _Cached, m: int) -> None:
    """This rank needs more rows than ``old`` holds; its peers, already in the op's call for this
    step, may not. Before any host collective, take part in that call with M = the op's capacity,
    a count no call on it can have (calls stop at ``limit``): every rank's collective compares the
    Ms (the spin bound's check), so a peer that did not grow raises ``TokenCountError`` naming this
    rank, and this rank raises one naming it. Without that check (bound off) there is nothing to
    compare with: the growth goes on to the votes."""
    op = old.op
    if op.tp == 1 or not op.spin.checks_token_counts:
        return
    filler = torch.full((op.capacity, op.hidden_size), float("nan"), dtype=torch.bfloat16, device=op.device)
    op(filler, out=filler)
    torch.cuda.synchronize(op.device)
    try:
        op.check()
    except TokenCountError as error:
        ranks = sorted(rank for rank in error.peer_m if rank != op.rank)
        peers = ", ".join(f"rank {rank} M = {error.peer_m[rank]}" for rank in ranks)
        raise TokenCountError(
            f"rank {op.rank}: lamport_all_reduce with M = {m}, above the max_num_tokens = {old.limit} its op holds, "
            f"while {peers} called it within that (a rank that grows alone cannot rebuild: every rank must pass "
            "the same M, or the same max_num_tokens); the op is unusable on every rank: "
            "close_lamport_all_reduce(group) on every rank, then call again",
            m=m,
            peer_m={rank: error.peer_m[rank] for rank in ranks},
        ) from None


def _agree_on_growth(old: _Cached, capacity: int) -> None:
    """Every rank that grows asks for the same size (before the old op is closed), else
    ``TokenCountError`` on every rank naming the ranks and their sizes."""
    from .ranks.startup import Ballot, describe_values

    if old.op.tp == 1:
        return
    group = old.op.group
    ballots = group.exchange_ballots(Ballot(group.rank, "grow", {"max_num_tokens": capacity}), old.op.device)
    sizes = {ballot.rank: ballot.fingerprint["max_num_tokens"] for ballot in ballots}
    if len(set(sizes.values())) > 1:
        raise TokenCountError(
            f"rank {group.rank}: lamport_all_reduce: the ranks grow their op to different sizes "
            f"({describe_values(sizes)}): every rank must pass the same M (or max_num_tokens); nothing was "
            "closed, the op stays usable",
            m=capacity,
            peer_m={rank: size for rank, size in sizes.items() if size != capacity},
        )


def close_lamport_all_reduce(group: Any = None) -> None:
    """Close and forget the ops ``lamport_all_reduce`` keeps for ``group`` (None: tp = 1). Collective
    over the group, like ``close()``: call it on every rank (before destroying the group, or to build
    the ops anew after a timeout). Waits for calls using them on other threads to return."""
    with _CACHE:
        dropped = list(_OPS.pop(group, {}).values())
        while any(cached.users for cached in dropped):
            _CACHE.wait()
    for cached in dropped:
        cached.op.close()


def _forget_destroyed_groups() -> None:
    """Drop the ops of process groups destroyed since they were built (a destroyed group runs no
    collective, so they cannot be closed; their memory goes with them)."""
    for group in [group for group in _OPS if group is not None and _destroyed(group)]:
        del _OPS[group]
        _BUILDS.pop(group, None)


def _destroyed(group: Any) -> bool:
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        return False
    if not dist.is_initialized():
        return True
    try:
        dist.get_rank(group)  # a group torch no longer knows raises
    except (ValueError, RuntimeError):
        return True
    return False
