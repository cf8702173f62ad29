"""The standalone Lamport all-reduce: publish + plain collective for any ``[M, hidden]`` BF16 tensor.

``LamportAllReduce`` is the op (any group, any transport, plain or MoE-finalize
input); ``lamport_all_reduce`` is a function over it that keeps one op per
(group, device, hidden, transport) and rebuilds it, collectively, when a larger M
arrives. The result is the BF16 rounding of the FP32 sum over ranks in the order
``mhc_core.reference.tp_sum`` gives, bit-identical on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ..device.configs import COLLECTIVE_KERNEL, TRIGGER_AFTER_STORES, CollectiveConfig
from .calls import M, Rule, TensorRule, tensor
from .compiler import KernelSpec
from .moe import MoEOutput
from .op import LamportOp
from .programs import Launch, Pointer, Source
from .startup import collective


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
        )
        self.lanes = lanes
        config = CollectiveConfig(hidden=hidden_size, tp=self.tp, threads=threads, lanes=lanes)
        self._build_publishes()
        self._collective_kernel = self._compile(KernelSpec(COLLECTIVE_KERNEL, config))
        self._setup()

    def _collect_rules(self) -> tuple[Rule, ...]:
        return ()

    def _output_rules(self) -> tuple[TensorRule, ...]:
        return (tensor("out", (M, self.hidden_size), dtype=torch.bfloat16),)

    def _collect_launches(self, *, direct: bool, prefetch: Source) -> list[Launch]:
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


_OPS: dict[tuple, LamportAllReduce] = {}


def lamport_all_reduce(
    x: torch.Tensor | MoEOutput,
    *,
    group: Any = None,
    transport: str | None = None,
    max_num_tokens: int | None = None,
    out: torch.Tensor | None = None,
    spin_timeout_ms: float | None = None,
) -> torch.Tensor:
    """All-reduce ``x`` (``[M, hidden]`` BF16) over ``group`` with the Lamport protocol.

    Keeps one ``LamportAllReduce`` per (group, device, hidden, transport); the first
    call, and any call with a larger M than the op holds, builds it collectively,
    so every rank must make the same calls. For loopback ranks use
    ``LamportAllReduce`` with ``LoopbackGroup.run`` (one process holds every rank).
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
    m, hidden = shared.shape
    top_k = x.expert_weights.shape[1] if isinstance(x, MoEOutput) and x.expert_weights.dim() == 2 else 0
    key = (id(group), shared.device, hidden, transport, top_k)
    op = _OPS.get(key)
    if op is None or op.capacity < max(m, max_num_tokens or 0):
        capacity = max(m, max_num_tokens or 0, op.capacity if op is not None else 0)
        op = LamportAllReduce(
            hidden_size=hidden,
            max_num_tokens=capacity,
            device=shared.device,
            group=group,
            transport=transport,
            top_k=top_k,
            spin_timeout_ms=spin_timeout_ms,
        )
        _OPS[key] = op
    return op(x, out=out)
