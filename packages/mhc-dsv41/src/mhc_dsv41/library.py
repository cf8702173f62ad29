"""torch.library custom ops of DSV4.1's boundary (namespace ``mhc``; see ``mhc_core.host.library``).

``mhc::dsv41_boundary`` is ``AllReduceMHC.__call__``, ``mhc::dsv41_finalize`` its MoE form and
``mhc::dsv41_collect`` phase two after ``mhc::publish`` / ``mhc::publish_moe``. Each takes the
op's state (mutated: the calls keep their order) and handle, and returns ``(residual_out
[M, hc, hidden], layer_input [M, hidden])``, both BF16. ``boundary`` / ``finalize`` /
``collect`` below take the op itself.

An op built with an FP8 ``layer_input_format`` (issue #33) goes through ``mhc::dsv41_boundary_fp8``,
``mhc::dsv41_finalize_fp8`` and ``mhc::dsv41_collect_fp8``: the same arguments, then the format and
``layer_input_bf16`` (checked against the op's: the fake implementations derive the outputs from the
arguments alone), returning ``(residual_out, q, scales, layer_input)``, ``layer_input`` empty
unless kept (``mhc_core.host.layer_input``: ``q`` ``float8_e4m3fn [M, hidden]``, ``scales`` of the
format's shape, strides and allocation, ``mhc_core.fp8.Fp8Format.empty_scales``). Separate ops, so
the BF16 ones keep their schema and cost; the wrappers pick by the op's format and return a tuple.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mhc_core.host import library
from mhc_core.host.layer_input import LayerInput
from mhc_core.host.moe import MoEOutput  # at import: an import inside a wrapper costs each call

if TYPE_CHECKING:  # the wrappers below are typed by the op class (imported by the caller already)
    from .op import AllReduceMHC


@library.custom_op("dsv41_boundary")
def dsv41_boundary(
    state: Tensor,
    handle: int,
    x: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
) -> tuple[Tensor, Tensor]:
    return library.run(handle, state, lambda op: op(x, residual, post, comb, pre, norm_weight, norm_eps))


@dsv41_boundary.register_fake
def _(state, handle, x, residual, post, comb, pre, norm_weight, norm_eps):
    return torch.empty_like(residual), torch.empty_like(x)


@library.custom_op("dsv41_finalize")
def dsv41_finalize(
    state: Tensor,
    handle: int,
    gemm2_permuted: Tensor,
    expert_weights: Tensor,
    index: Tensor,
    shared_output: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
) -> tuple[Tensor, Tensor]:
    moe = (gemm2_permuted, expert_weights, index, shared_output)
    return library.run(handle, state, lambda op: op.finalize(*moe, residual, post, comb, pre, norm_weight, norm_eps))


@dsv41_finalize.register_fake
def _(
    state,
    handle,
    gemm2_permuted,
    expert_weights,
    index,
    shared_output,
    residual,
    post,
    comb,
    pre,
    norm_weight,
    norm_eps,
):
    return torch.empty_like(residual), torch.empty_like(shared_output)


@library.custom_op("dsv41_collect")
def dsv41_collect(
    state: Tensor,
    handle: int,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
) -> tuple[Tensor, Tensor]:
    return library.run(handle, state, lambda op: op.collect(residual, post, comb, pre, norm_weight, norm_eps))


@dsv41_collect.register_fake
def _(state, handle, residual, post, comb, pre, norm_weight, norm_eps):
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
    def checked(op: AllReduceMHC) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        wanted = LayerInput(layer_input_format, layer_input_bf16)
        if op.layer_input != wanted:
            raise ValueError(
                f"layer_input_format: the op behind handle {handle} writes {op.layer_input.format!r} "
                f"(layer_input_bf16={op.layer_input.keep_bf16}), the call asks for {layer_input_format!r} "
                f"(layer_input_bf16={layer_input_bf16})"
            )
        return wanted.op_outputs(tuple(call(op)))

    return library.run(handle, state, checked)


@library.custom_op("dsv41_boundary_fp8")
def dsv41_boundary_fp8(
    state: Tensor,
    handle: int,
    x: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    layer_input_format: str,
    layer_input_bf16: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_fp8(
        handle, state, layer_input_format, layer_input_bf16,
        lambda op: op(x, residual, post, comb, pre, norm_weight, norm_eps),
    )  # fmt: skip


@dsv41_boundary_fp8.register_fake
def _(state, handle, x, residual, post, comb, pre, norm_weight, norm_eps, layer_input_format, layer_input_bf16):
    return _fp8_outputs(residual, x, layer_input_format, layer_input_bf16)


@library.custom_op("dsv41_finalize_fp8")
def dsv41_finalize_fp8(
    state: Tensor,
    handle: int,
    gemm2_permuted: Tensor,
    expert_weights: Tensor,
    index: Tensor,
    shared_output: Tensor,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    layer_input_format: str,
    layer_input_bf16: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    moe = (gemm2_permuted, expert_weights, index, shared_output)
    return _run_fp8(
        handle, state, layer_input_format, layer_input_bf16,
        lambda op: op.finalize(*moe, residual, post, comb, pre, norm_weight, norm_eps),
    )  # fmt: skip


@dsv41_finalize_fp8.register_fake
def _(
    state,
    handle,
    gemm2_permuted,
    expert_weights,
    index,
    shared_output,
    residual,
    post,
    comb,
    pre,
    norm_weight,
    norm_eps,
    layer_input_format,
    layer_input_bf16,
):
    return _fp8_outputs(residual, shared_output, layer_input_format, layer_input_bf16)


@library.custom_op("dsv41_collect_fp8")
def dsv41_collect_fp8(
    state: Tensor,
    handle: int,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    layer_input_format: str,
    layer_input_bf16: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_fp8(
        handle, state, layer_input_format, layer_input_bf16,
        lambda op: op.collect(residual, post, comb, pre, norm_weight, norm_eps),
    )  # fmt: skip


@dsv41_collect_fp8.register_fake
def _(state, handle, residual, post, comb, pre, norm_weight, norm_eps, layer_input_format, layer_input_bf16):
    return _fp8_outputs(residual, None, layer_input_format, layer_input_bf16)


# -------------------------------------------------------------------- wrappers


def boundary(
    op: AllReduceMHC,
    x: Tensor | MoEOutput,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float | None = None,
) -> tuple[Tensor, ...]:
    """``op(x, ...)`` (or ``op.finalize`` for a ``MoEOutput`` x) of an ``AllReduceMHC`` through the custom ops
    (``norm_eps`` None: the op's): what the op's call returns, ``(residual_out, layer_input)`` or, with an
    FP8 layer input, ``(residual_out, q, scales[, layer_input])``."""
    norm_eps = op.norm_eps if norm_eps is None else norm_eps
    if library.eager(op, residual):  # the op's own call (``mhc_core.host.library.eager``)
        if isinstance(x, MoEOutput):
            return op.finalize(
                x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output,
                residual, post, comb, pre, norm_weight, norm_eps,
            )  # fmt: skip
        return op(x, residual, post, comb, pre, norm_weight, norm_eps)
    fmt = getattr(op, "layer_input", None)  # a stand-in with state and handle alone: BF16
    if fmt is not None and fmt.quantizes:
        if isinstance(x, MoEOutput):
            return fmt.call_outputs(
                torch.ops.mhc.dsv41_finalize_fp8(
                    op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx,
                    x.shared_output, residual, post, comb, pre, norm_weight, norm_eps, fmt.format, fmt.keep_bf16,
                )
            )  # fmt: skip
        return fmt.call_outputs(
            torch.ops.mhc.dsv41_boundary_fp8(
                op.state, op.handle, x, residual, post, comb, pre, norm_weight, norm_eps, fmt.format, fmt.keep_bf16
            )
        )

    if isinstance(x, MoEOutput):
        return torch.ops.mhc.dsv41_finalize(
            op.state, op.handle, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output,
            residual, post, comb, pre, norm_weight, norm_eps,
        )  # fmt: skip
    return torch.ops.mhc.dsv41_boundary(op.state, op.handle, x, residual, post, comb, pre, norm_weight, norm_eps)


def collect(
    op: AllReduceMHC,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float | None = None,
) -> tuple[Tensor, ...]:
    """``op.collect(...)`` through the custom ops (after ``mhc_core.host.library.publish_input``;
    ``norm_eps`` None: the op's), returning as ``boundary`` does."""
    norm_eps = op.norm_eps if norm_eps is None else norm_eps
    if library.eager(op, residual):
        return op.collect(residual, post, comb, pre, norm_weight, norm_eps)
    fmt = getattr(op, "layer_input", None)  # a stand-in with state and handle alone: BF16
    if fmt is not None and fmt.quantizes:
        return fmt.call_outputs(
            torch.ops.mhc.dsv41_collect_fp8(
                op.state, op.handle, residual, post, comb, pre, norm_weight, norm_eps, fmt.format, fmt.keep_bf16
            )
        )
    return torch.ops.mhc.dsv41_collect(op.state, op.handle, residual, post, comb, pre, norm_weight, norm_eps)
