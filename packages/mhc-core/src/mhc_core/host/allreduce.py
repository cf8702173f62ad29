"""The standalone Lamport all-reduce: publish + plain collective for any ``[M, hidden]`` BF16 tensor.

``LamportAllReduce`` is the op (any group, any transport, plain or MoE-finalize
input); ``lamport_all_reduce`` is a function over it that keeps one op per (group, device,
hidden, top_k) and replaces it, collectively, when a larger M or other settings arrive
(``close_lamport_all_reduce`` closes them). The result is the BF16 rounding of the FP32 sum
over ranks in the order ``mhc_core.reference.tp_sum`` gives, bit-identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..device.configs import COLLECTIVE_KERNEL, TRIGGER_AFTER_STORES, CollectiveConfig
from ..protocols import ONE_SHOT
from .allocation import requested_allocation
from .calls import IN_PLACE_LAYER_INPUT, M, Rule, TensorRule, tensor
from .compiler import KernelSpec
from .mailbox import requested_transport
from .moe import MoEOutput
from .op import MAX_NUM_TOKENS, LamportOp
from .programs import Launch, Pointer, Source
from .spin import resolve_timeout_ms
from .startup import collective
from .validation import check_int


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


#: group -> (device, hidden, top_k) -> the op. Keyed by the group object itself (None: tp = 1), never by
#: its ``id()``, which Python gives a new object once the old one is gone. A weak key would not help:
#: each op holds its group. A group destroyed with ``torch.distributed.destroy_process_group`` loses
#: its ops at the next build (dropped, not closed: a destroyed group runs no collective).
_OPS: dict[Any, dict[tuple[Any, ...], _Cached]] = {}


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
    """
    from .groups import LoopbackRank

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
    cached = _OPS.get(group, {}).get(slot)
    capacity = max(m, max_num_tokens or 0)
    if cached is None or cached.settings != settings or cached.op.capacity < capacity:
        cached = _replace(group, slot, cached, settings, capacity)
    return cached.op(x, out=out)


def _requested_settings(transport: str | None, spin_timeout_ms: float | None, allocation: str | None) -> tuple:
    """What an op is built with beyond its shape, as requested (validated; environment read)."""
    return requested_transport(transport)[0], resolve_timeout_ms(spin_timeout_ms), requested_allocation(allocation)


def _replace(
    group: Any, slot: tuple[Any, ...], old: _Cached | None, settings: tuple[Any, ...], capacity: int
) -> _Cached:
    """Close ``old`` (collectively), then build the slot's op (collectively) with ``settings``."""
    _forget_destroyed_groups()
    ops = _OPS.setdefault(group, {})
    if old is not None:
        capacity = max(capacity, old.op.capacity)
        del ops[slot]  # gone from the cache even if a rank fails to close it or to build the next
        old.op.close()
    device, hidden, top_k = slot
    transport, spin_timeout_ms, allocation = settings
    op = LamportAllReduce(
        hidden_size=hidden, max_num_tokens=capacity, device=device, group=group, transport=transport, top_k=top_k,
        spin_timeout_ms=spin_timeout_ms or 0, mailbox_allocation=allocation,
    )  # fmt: skip
    ops[slot] = _Cached(op, settings)
    return ops[slot]


def close_lamport_all_reduce(group: Any = None) -> None:
    """Close and forget the ops ``lamport_all_reduce`` keeps for ``group`` (None: tp = 1). Collective
    over the group, like ``close()``: call it on every rank (before destroying the group, or to build
    the ops anew after a timeout)."""
    for cached in _OPS.pop(group, {}).values():
        cached.op.close()


def _forget_destroyed_groups() -> None:
    """Drop the ops of process groups destroyed since they were built (a destroyed group runs no
    collective, so they cannot be closed; their memory goes with them)."""
    for group in [group for group in _OPS if group is not None and _destroyed(group)]:
        del _OPS[group]


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
