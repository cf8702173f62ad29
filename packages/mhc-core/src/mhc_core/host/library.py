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

Registration (``custom_op`` below) goes through ``torch.library.Library``'s lower-level API, as
vLLM's ``direct_register_custom_op`` does: the schema inferred from the implementation's type hints,
the implementation registered for the CUDA dispatch key alone, the fake one through
``torch.library.register_fake``. An eager call then runs one Python kernel, where torch's
``custom_op`` decorator adds its autograd and ADInplaceOrView kernels in Python (together about
8 times a direct call's host instructions; BENCHMARKS.md). What that costs: no autograd kernel (the
dispatcher's autograd fallback: outputs that do not require grad, a warning if one is
backpropagated through), which inference does not need.

This module registers the core's ops (the standalone all-reduce, plain and MoE input, and the
two-phase ``publish`` / ``all_reduce_collect``); ``mhc_dsv41.library`` and ``mhc_glm5.library``
register the fused boundaries. Typed wrappers that take the op itself come with each.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from .calls.moe import MoEOutput

_HANDLES = itertools.count(1)
_OPS: dict[int, weakref.ref] = {}
#: Every ``mhc`` op's definition and kernels (kept alive: the registrations last as long as it).
_LIBRARY = torch.library.Library("mhc", "FRAGMENT")

Implementation = TypeVar("Implementation", bound=Callable[..., Any])
# ``eager``'s checks, bound once (a wrapper's eager call pays microseconds for each attribute chain).
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled


class CustomOp(Generic[Implementation]):
    """``torch.ops.mhc.<name>``, defined and registered by ``custom_op``. Calling it calls the op
    (``torch.ops.mhc.<name>(...)``); ``implementation`` is the Python function behind it."""

    def __init__(self, name: str, implementation: Implementation, mutates_args: tuple[str, ...]) -> None:
        self.name = name
        self.qualname = f"mhc::{name}"
        self.implementation = implementation
        self.__doc__ = implementation.__doc__
        _LIBRARY.define(name + torch.library.infer_schema(implementation, mutates_args=mutates_args))
        _LIBRARY.impl(name, implementation, "CUDA")

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the fake implementation (shapes and dtypes from the inputs alone)."""
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake

    @property
    def overload(self) -> torch._ops.OpOverload:
        """``torch.ops.mhc.<name>.default``."""
        return getattr(torch.ops.mhc, self.name).default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(torch.ops.mhc, self.name)(*args, **kwargs)


def custom_op(name: str, *, mutates_args: tuple[str, ...] = ("state",)) -> Callable[[Implementation], CustomOp]:
    """Decorator: define ``mhc::<name>`` from a CUDA implementation (see the module docstring)."""

    def define(implementation: Implementation) -> CustomOp[Implementation]:
        return CustomOp(name, implementation, mutates_args)

    return define


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


def eager(op: Any, tensor: Any) -> bool:
    """Whether a wrapper below may call ``op`` itself instead of ``torch.ops.mhc`` (the eager bypass,
    as quack's ``cute_op``): the same call the custom op's kernel makes, without the dispatcher's cost.
    Only in eager mode proper: not while ``torch.compile`` traces, not on a tensor subclass (fake,
    functional, a tracing proxy), not under a torch function or dispatch mode (they would not see the
    call), and only for a live op registered under its handle (not a tracing stand-in or a closed op,
    whose errors come from the custom op)."""
    if _is_compiling():  # first: torch.compile folds it to True and traces nothing past it
        return False
    if type(tensor) is not Tensor or _dispatch_modes() or _function_modes():
        return False
    ref = _OPS.get(op.handle)
    return ref is not None and ref() is op


def lookup(handle: int) -> Any:
    """The op behind ``handle``; a clear error for a handle whose op is gone or never was."""
    ref = _OPS.get(handle)
    op = ref() if ref is not None else None
    if op is None:
        raise ValueError(f"handle: no live mhc op has handle {handle} (was the op closed or garbage-collected?)")
    return op


# ------------------------------------------------------------------ all-reduce
@custom_op("all_reduce")
def all_reduce(state: Tensor, handle: int, x: Tensor) -> Tensor:
    """``LamportAllReduce.__call__``: the ``[M, hidden]`` BF16 sum of every rank's ``x``."""
    return run(handle, state, lambda op: op(x))


@all_reduce.register_fake
def _(state: Tensor, handle: int, x: Tensor) -> Tensor:
    return torch.empty_like(x)


@custom_op("all_reduce_moe")
def all_reduce_moe(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> Tensor:
    """``LamportAllReduce.__call__`` of an unfinalized MoE output (``mhc_core.MoEOutput``)."""
    return run(handle, state, lambda op: op(MoEOutput(gemm2_permuted, expert_weights, index, shared_output)))


@all_reduce_moe.register_fake
def _(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> Tensor:
    return torch.empty_like(shared_output)


# ------------------------------------------------------------------ two phases
@custom_op("publish")
def publish(state: Tensor, handle: int, x: Tensor) -> None:
    """Phase one of any op (``LamportOp.publish``); the model's collect op is phase two."""
    run(handle, state, lambda op: op.publish(x))


@publish.register_fake
def _(state: Tensor, handle: int, x: Tensor) -> None:
    return None


@custom_op("publish_moe")
def publish_moe(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> None:
    """Phase one with an unfinalized MoE output."""
    run(handle, state, lambda op: op.publish(MoEOutput(gemm2_permuted, expert_weights, index, shared_output)))


@publish_moe.register_fake
def _(
    state: Tensor, handle: int, gemm2_permuted: Tensor, expert_weights: Tensor, index: Tensor, shared_output: Tensor
) -> None:
    return None


@custom_op("all_reduce_collect")
def all_reduce_collect(state: Tensor, handle: int, like: Tensor) -> Tensor:
    """``LamportAllReduce.collect``; ``like`` is the published tensor (the result's shape)."""
    return run(handle, state, lambda op: op.collect())


@all_reduce_collect.register_fake
def _(state: Tensor, handle: int, like: Tensor) -> Tensor:
    return torch.empty_like(like)


# -------------------------------------------------------------------- wrappers
def lamport_all_reduce(op: Any, x: Any) -> Tensor:
    """``op(x)`` of a ``LamportAllReduce`` through the custom ops (``x``: a tensor or a MoEOutput)."""
    moe = isinstance(x, MoEOutput)
    if eager(op, x.shared_output if moe else x):
        return op(x)
    if moe:
        return torch.ops.mhc.all_reduce_moe(
            op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output
        )
    return torch.ops.mhc.all_reduce(op.state, op.handle, x)


def publish_input(op: Any, x: Any) -> None:
    """``op.publish(x)`` through the custom ops (any op; ``x``: a tensor or a MoEOutput)."""
    moe = isinstance(x, MoEOutput)
    if eager(op, x.shared_output if moe else x):
        op.publish(x)
    elif moe:
        torch.ops.mhc.publish_moe(
            op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output
        )
    else:
        torch.ops.mhc.publish(op.state, op.handle, x)
