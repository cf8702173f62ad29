"""torch.library custom ops of DSV4.1's boundary (namespace ``mhc``; see ``mhc_core.host.library``).

``mhc::dsv41_boundary`` is ``AllReduceMHC.__call__``, ``mhc::dsv41_finalize`` its MoE form and
``mhc::dsv41_collect`` phase two after ``mhc::publish`` / ``mhc::publish_moe``. Each takes the
op's state (mutated: the calls keep their order) and handle, and returns ``(residual_out
[M, hc, hidden], layer_input [M, hidden])``, both BF16. ``boundary`` / ``finalize`` /
``collect`` below take the op itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mhc_core.host import library

if TYPE_CHECKING:  # the wrappers below are typed by the op class (imported by the caller already)
    from mhc_core.host.moe import MoEOutput

    from .op import AllReduceMHC


@torch.library.custom_op("mhc::dsv41_boundary", mutates_args=("state",), device_types="cuda")
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


@torch.library.custom_op("mhc::dsv41_finalize", mutates_args=("state",), device_types="cuda")
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


@torch.library.custom_op("mhc::dsv41_collect", mutates_args=("state",), device_types="cuda")
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


def boundary(
    op: AllReduceMHC,
    x: Tensor | MoEOutput,
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    pre: Tensor,
    norm_weight: Tensor,
    norm_eps: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``op(x, ...)`` (or ``op.finalize`` for a ``MoEOutput`` x) of an ``AllReduceMHC`` through the custom ops
    (``norm_eps`` None: the op's)."""
    from mhc_core.host.moe import MoEOutput

    norm_eps = op.norm_eps if norm_eps is None else norm_eps

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
) -> tuple[Tensor, Tensor]:
    """``op.collect(...)`` through the custom ops (after ``mhc_core.host.library.publish_input``;
    ``norm_eps`` None: the op's)."""
    norm_eps = op.norm_eps if norm_eps is None else norm_eps
    return torch.ops.mhc.dsv41_collect(op.state, op.handle, residual, post, comb, pre, norm_weight, norm_eps)
