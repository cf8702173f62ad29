"""torch.library custom ops (namespace ``mhc``): the fused ops inside ``torch.compile``'d models.

An op instance is reached through its handle (``LamportOp.handle``, an int) and carries its
state (``LamportOp.state``, the int32 stage state the kernels advance). Every custom op here
declares that state tensor mutated: no compiler pass can reorder, duplicate or drop a call,
since each one mutates the same tensor the next one reads. The state is marked a static
address when the op is built, so a ``mode="reduce-overhead"`` graph sees the mutation of a
static input and stays a CUDA graph. The fake implementations derive every output's shape
and dtype from the inputs alone: tracing needs no op and no GPU. The ops are for inference: they
have no autograd formula, so compile the model under ``torch.inference_mode()`` or
``torch.no_grad()`` (or with parameters that do not require grad), as engines do.

This module registers the core's ops (the standalone all-reduce, plain and MoE input, and the
two-phase ``publish`` / ``all_reduce_collect``); ``mhc_dsv41.library`` and ``mhc_glm5.library``
register the fused boundaries. Typed wrappers that take the op itself come with each.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_HANDLES = itertools.count(1)
_OPS: dict[int, weakref.ref] = {}


def register(op: Any) -> int:
    """A new handle for ``op`` (kept as a weak reference: the handle dies with the op)."""
    handle = next(_HANDLES)
    _OPS[handle] = weakref.ref(op, lambda _, handle=handle: _OPS.pop(handle, None))
    torch._dynamo.mark_static_address(op.state)
    return handle


def unregister(handle: int) -> None:
    """Forget ``handle`` (the op was closed): a custom op called with it raises."""
    _OPS.pop(handle, None)


def run(handle: int, state: Tensor, call: Callable[[Any], Any]) -> Any:
    """``call(op)`` for the op behind ``handle``; then, where ``state`` is not the op's own stage
    state (a functionalized graph, e.g. ``torch.compile(backend="aot_eager")`` or opcheck, hands the
    op a copy and writes it back afterwards), the op's advanced state is copied into it, so the
    write-back cannot roll the mailbox generation back. Both under the op's lock (its calls take it
    again: an RLock), so another thread's call of the op comes before or after, never in between."""
    op = lookup(handle)
    with op._lock:
        result = call(op)
        own = op.state
        if state.data_ptr() != own.data_ptr():
            state.copy_(own)
    return result


def lookup(handle: int) -> Any:
    """The op behind ``handle``; a clear error for a handle whose op is gone or never was."""
    ref = _OPS.get(handle)
    op = ref() if ref is not None else None
    if op is None:
        raise ValueError(f"handle: no live mhc op has handle {handle} (was the op closed or garbage-collected?)")
    return op


# ------------------------------------------------------------------ all-reduce
@torch.library.custom_op("mhc::all_reduce", mutates_args=("state",), device_types="cuda")
def all_reduce(state: Tensor, handle: int, x: Tensor) -> Tensor:
    """``LamportAllReduce.__call__``: the ``[M, hidden]`` BF16 sum of every rank's ``x``."""
    return run(handle, state, lambda op: op(x))


@all_reduce.register_fake
def _(state: Tensor, handle: int, x: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mhc::all_reduce_moe", mutates_args=("state",), device_types="cuda")
def all_reduce_moe(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> Tensor:
    """``LamportAllReduce.__call__`` of an unfinalized MoE output (``mhc_core.MoEOutput``)."""
    from .moe import MoEOutput

    return run(handle, state, lambda op: op(MoEOutput(gemm2_permuted, expert_weights, index, shared_output)))


@all_reduce_moe.register_fake
def _(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> Tensor:
    return torch.empty_like(shared_output)


# ------------------------------------------------------------------ two phases
@torch.library.custom_op("mhc::publish", mutates_args=("state",), device_types="cuda")
def publish(state: Tensor, handle: int, x: Tensor) -> None:
    """Phase one of any op (``LamportOp.publish``); the model's collect op is phase two."""
    run(handle, state, lambda op: op.publish(x))


@publish.register_fake
def _(state: Tensor, handle: int, x: Tensor) -> None:
    return None


@torch.library.custom_op("mhc::publish_moe", mutates_args=("state",), device_types="cuda")
def publish_moe(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> None:
    """Phase one with an unfinalized MoE output."""
    from .moe import MoEOutput

    run(handle, state, lambda op: op.publish(MoEOutput(gemm2_permuted, expert_weights, index, shared_output)))


@publish_moe.register_fake
def _(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> None:
    return None


@torch.library.custom_op("mhc::all_reduce_collect", mutates_args=("state",), device_types="cuda")
def all_reduce_collect(state: Tensor, handle: int, like: Tensor) -> Tensor:
    """``LamportAllReduce.collect``; ``like`` is the published tensor (the result's shape)."""
    return run(handle, state, lambda op: op.collect())


@all_reduce_collect.register_fake
def _(state: Tensor, handle: int, like: Tensor) -> Tensor:
    return torch.empty_like(like)


# -------------------------------------------------------------------- wrappers
def lamport_all_reduce(op: Any, x: Any) -> Tensor:
    """``op(x)`` of a ``LamportAllReduce`` through the custom ops (``x``: a tensor or a MoEOutput)."""
    from .moe import MoEOutput

    if isinstance(x, MoEOutput):
        return torch.ops.mhc.all_reduce_moe(
            op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output
        )
    return torch.ops.mhc.all_reduce(op.state, op.handle, x)


def publish_input(op: Any, x: Any) -> None:
    """``op.publish(x)`` through the custom ops (any op; ``x``: a tensor or a MoEOutput)."""
    from .moe import MoEOutput

    if isinstance(x, MoEOutput):
        torch.ops.mhc.publish_moe(
            op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output
        )
    else:
        torch.ops.mhc.publish(op.state, op.handle, x)
