"""torch.library custom ops of GLM-5.3's boundary (namespace ``mhc``; see ``mhc_core.host.library``).

``mhc::glm5_boundary`` is ``AllReduceMhcBoundary.__call__`` (``mhc::glm5_boundary_moe`` with MoE
input, ``mhc::glm5_collect`` phase two after ``mhc::publish``): it returns ``(residual_out,
layer_input)``, complete when it returns, and leaves the post-mix and residual mix to the side
stream. ``mhc::glm5_join`` makes the current stream wait for them and returns ``(post_out
[M, 4, 1], comb_out [M, 4, 4])`` FP32: their only source, so a compiled graph cannot use them
before the join, and the side-stream kernel still overlaps whatever the graph runs between
the boundary and the join. Every op takes the op's state (mutated: the calls keep their order)
and handle; ``boundary`` / ``collect`` / ``join`` below take the op itself.

Threads: each op here is one call of the op under its lock, the hand-over of the side outputs
included. A join returns the side outputs of the op's last boundary call, whichever thread made
it: threads sharing one op pair their boundary and join calls under a lock of their own.

An op built with an FP8 ``layer_input_format`` (issue #33) goes through ``mhc::glm5_boundary_fp8``,
``mhc::glm5_boundary_moe_fp8`` and ``mhc::glm5_collect_fp8``: the same arguments, then the format and
``layer_input_bf16`` (checked against the op's: the fake implementations derive the outputs from the
arguments alone), returning ``(residual_out, q, scales, layer_input)``, ``layer_input`` empty
unless kept (``mhc_core.host.layer_input``: ``q`` ``float8_e4m3fn [M, hidden]``, ``scales`` of the
format's shape, strides and allocation, ``mhc_core.fp8.Fp8Format.empty_scales``); ``mhc::glm5_join``
is the same for both. Separate ops, so that the BF16 ones keep their schema and cost; the wrappers
pick by the op's format and return a tuple.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mhc_core.host import library
from mhc_core.host.layer_input import LayerInput
from mhc_core.host.moe import MoEOutput  # at import: an import inside a wrapper costs each call

if TYPE_CHECKING:  # the wrappers below are typed by the op class (imported by the caller already)
    from .op import AllReduceMhcBoundary

from .config import HC

#: Per handle, the side-stream outputs of the last boundary call, until its join.
_UNJOINED: dict[int, tuple[Tensor, Tensor]] = {}
#: The layer input of an op-like object that names none (a stand-in with only ``state`` and
#: ``handle``, as the demo's and the benchmarks' tracing tests pass): BF16.
_BF16 = LayerInput()


def _layer_input(op: Any) -> LayerInput:
    return getattr(op, "layer_input", _BF16)


def _fused(handle: int, outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Keep a boundary call's side outputs for its join (called under the op's lock); the rest:
    ``(residual_out, layer_input)``, or ``(residual_out, q, scales[, layer_input])`` with FP8."""
    _UNJOINED[handle] = (outputs[1], outputs[2])
    return (outputs[0], outputs[3]) if len(outputs) == 4 else (outputs[0], *outputs[3:])


def _joined(handle: int, op: Any) -> tuple[Tensor, Tensor]:
    """The last boundary call's side outputs, once the current stream waits for them (under the op's lock)."""
    unjoined = _UNJOINED.pop(handle, None)
    if unjoined is None:
        raise RuntimeError(f"mhc::glm5_join: op handle {handle} has no boundary call to join")
    op.join()
    return unjoined


@library.custom_op("glm5_boundary")
def glm5_boundary(
    state: Tensor,
    handle: int,
    x: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
) -> tuple[Tensor, Tensor]:
    return library.run(
        handle, state, lambda op: _fused(handle, op(x, residual, post, comb, fn, scale, base, norm_weight))
    )


@glm5_boundary.register_fake
def _(state, handle, x, residual, post, comb, fn, scale, base, norm_weight):
    return torch.empty_like(residual), torch.empty_like(x)


@library.custom_op("glm5_boundary_moe")
def glm5_boundary_moe(
    state: Tensor,
    handle: int,
    gemm2_permuted: Tensor,
    expert_weights: Tensor,
    index: Tensor,
    shared_output: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
) -> tuple[Tensor, Tensor]:
    moe = MoEOutput(gemm2_permuted, expert_weights, index, shared_output)
    return library.run(
        handle, state, lambda op: _fused(handle, op(moe, residual, post, comb, fn, scale, base, norm_weight))
    )


@glm5_boundary_moe.register_fake
def _(state, handle, gemm2_permuted, expert_weights, index, shared_output, residual, post, comb, fn, scale, base,
      norm_weight):  # fmt: skip
    return torch.empty_like(residual), torch.empty_like(shared_output)


@library.custom_op("glm5_collect")
def glm5_collect(
    state: Tensor,
    handle: int,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
) -> tuple[Tensor, Tensor]:
    return library.run(
        handle, state, lambda op: _fused(handle, op.collect(residual, post, comb, fn, scale, base, norm_weight))
    )


@glm5_collect.register_fake
def _(state, handle, residual, post, comb, fn, scale, base, norm_weight):
    return torch.empty_like(residual), residual.new_empty(residual.shape[0], residual.shape[2])


# ------------------------------------------------------------------ FP8 layer input
def _fp8_outputs(
    residual: Tensor, like: Tensor | None, layer_input_format: str, layer_input_bf16: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fake outputs: ``like`` is the publish input (x, the MoE shared output) or None (a collect)."""
    m, hidden = residual.shape[0], residual.shape[2]
    layer_input = LayerInput(layer_input_format, layer_input_bf16)
    return layer_input.op_outputs((torch.empty_like(residual), *layer_input.allocate(like, residual, m, hidden)))


def _run_fp8(
    handle: int, state: Tensor, layer_input_format: str, layer_input_bf16: bool, call
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``call(op)`` (the op's outputs) with the side outputs kept for the join, once the op is known to
    write the format the call's fake implementation assumed."""

    def checked(op: AllReduceMhcBoundary) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        wanted = LayerInput(layer_input_format, layer_input_bf16)
        if op.layer_input != wanted:
            raise ValueError(
                f"layer_input_format: the op behind handle {handle} writes {op.layer_input.format!r} "
                f"(layer_input_bf16={op.layer_input.keep_bf16}), the call asks for {layer_input_format!r} "
                f"(layer_input_bf16={layer_input_bf16})"
            )
        return wanted.op_outputs(_fused(handle, call(op)))

    return library.run(handle, state, checked)


@library.custom_op("glm5_boundary_fp8")
def glm5_boundary_fp8(
    state: Tensor,
    handle: int,
    x: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
    layer_input_format: str,
    layer_input_bf16: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_fp8(
        handle, state, layer_input_format, layer_input_bf16,
        lambda op: op(x, residual, post, comb, fn, scale, base, norm_weight),
    )  # fmt: skip


@glm5_boundary_fp8.register_fake
def _(state, handle, x, residual, post, comb, fn, scale, base, norm_weight, layer_input_format, layer_input_bf16):
    return _fp8_outputs(residual, x, layer_input_format, layer_input_bf16)


@library.custom_op("glm5_boundary_moe_fp8")
def glm5_boundary_moe_fp8(
    state: Tensor,
    handle: int,
    gemm2_permuted: Tensor,
    expert_weights: Tensor,
    index: Tensor,
    shared_output: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
    layer_input_format: str,
    layer_input_bf16: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    moe = MoEOutput(gemm2_permuted, expert_weights, index, shared_output)
    return _run_fp8(
        handle, state, layer_input_format, layer_input_bf16,
        lambda op: op(moe, residual, post, comb, fn, scale, base, norm_weight),
    )  # fmt: skip


@glm5_boundary_moe_fp8.register_fake
def _(state, handle, gemm2_permuted, expert_weights, index, shared_output, residual, post, comb, fn, scale, base,
      norm_weight, layer_input_format, layer_input_bf16):  # fmt: skip
    return _fp8_outputs(residual, shared_output, layer_input_format, layer_input_bf16)


@library.custom_op("glm5_collect_fp8")
def glm5_collect_fp8(
    state: Tensor,
    handle: int,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
    layer_input_format: str,
    layer_input_bf16: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_fp8(
        handle, state, layer_input_format, layer_input_bf16,
        lambda op: op.collect(residual, post, comb, fn, scale, base, norm_weight),
    )  # fmt: skip


@glm5_collect_fp8.register_fake
def _(state, handle, residual, post, comb, fn, scale, base, norm_weight, layer_input_format, layer_input_bf16):
    return _fp8_outputs(residual, None, layer_input_format, layer_input_bf16)


# ------------------------------------------------------------------ join
@library.custom_op("glm5_join")
def glm5_join(state: Tensor, handle: int, residual_out: Tensor) -> tuple[Tensor, Tensor]:
    """``residual_out``: the boundary call's first output (it gives M, and orders the join after it)."""
    return library.run(handle, state, lambda op: _joined(handle, op))  # a dead handle says so first


@glm5_join.register_fake
def _(state, handle, residual_out):
    m = residual_out.shape[0]
    return residual_out.new_empty(m, HC, 1, dtype=torch.float32), residual_out.new_empty(m, HC, HC, dtype=torch.float32)


def boundary(
    op: AllReduceMhcBoundary,
    x: Tensor | MoEOutput,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
) -> tuple[Tensor, ...]:
    """``op(x, ...)`` of an ``AllReduceMhcBoundary`` through the custom ops (``x``: a tensor or a
    ``MoEOutput``): ``(residual_out, layer_input)``, or with an FP8 layer input ``(residual_out, q,
    scales[, layer_input])``; ``join`` gives ``(post_out, comb_out)``."""
    if library.eager(op, residual):  # the op's own call (``mhc_core.host.library.eager``)
        # The call and the hand-over of its side outputs, as the custom op. `with`: an interrupt as
        # acquire() returns would otherwise leave the lock held (``mhc_core.host.eager._call``).
        with op._lock:
            return _fused(op.handle, op(x, residual, post, comb, fn, scale, base, norm_weight))
    fmt = _layer_input(op)
    if fmt.quantizes:
        if isinstance(x, MoEOutput):
            return fmt.call_outputs(
                torch.ops.mhc.glm5_boundary_moe_fp8(
                    op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx,
                    x.shared_output, residual, post, comb, fn, scale, base, norm_weight, fmt.format, fmt.keep_bf16,
                )
            )  # fmt: skip
        return fmt.call_outputs(
            torch.ops.mhc.glm5_boundary_fp8(
                op.state, op.handle, x, residual, post, comb, fn, scale, base, norm_weight, fmt.format, fmt.keep_bf16
            )
        )
    if isinstance(x, MoEOutput):
        return torch.ops.mhc.glm5_boundary_moe(
            op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output,
            residual, post, comb, fn, scale, base, norm_weight,
        )  # fmt: skip
    return torch.ops.mhc.glm5_boundary(op.state, op.handle, x, residual, post, comb, fn, scale, base, norm_weight)


def collect(
    op: AllReduceMhcBoundary,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    norm_weight: Tensor,
) -> tuple[Tensor, ...]:
    """``op.collect(...)`` through the custom ops (after ``mhc_core.host.library.publish_input``),
    returning as ``boundary`` does."""
    if library.eager(op, residual):
        with op._lock:
            return _fused(op.handle, op.collect(residual, post, comb, fn, scale, base, norm_weight))
    fmt = _layer_input(op)
    if fmt.quantizes:
        return fmt.call_outputs(
            torch.ops.mhc.glm5_collect_fp8(
                op.state, op.handle, residual, post, comb, fn, scale, base, norm_weight, fmt.format, fmt.keep_bf16
            )
        )
    return torch.ops.mhc.glm5_collect(op.state, op.handle, residual, post, comb, fn, scale, base, norm_weight)


def join(op: AllReduceMhcBoundary, residual_out: Tensor) -> tuple[Tensor, Tensor]:
    """``(post_out, comb_out)`` of the op's last boundary call, once the current stream waits for them."""
    if library.eager(op, residual_out):
        with op._lock:
            return _joined(op.handle, op)
    return torch.ops.mhc.glm5_join(op.state, op.handle, residual_out)
