"""The unfused boundary behind custom ops (``--diagnose``): what the integration efficiency loses to
inductor fusing the unfused boundary with its neighbours.

Inside the compiled model the unfused boundary is plain torch code, so inductor may fuse its first
and last elementwise kernels with the sublayers around it; the fused op (``torch.ops.mhc``) is opaque
and cannot be fused that way. The isolated per-boundary saving (``demo.isolated``) compiles each
boundary alone, without those neighbours. ``OpaqueUnfusedBoundary`` runs the same unfused code, each
boundary compiled on its own, behind a ``mhc_demo::`` custom op with a fake implementation: as
opaque to the model's graph as the fused op. The step time of this path minus the plain unfused
one is what inductor gained across the boundaries; the efficiency against this path is what the
fused ops keep of their isolated saving when both sides are equally opaque.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from mhc_core import MoEOutput

from .boundaries import UnfusedBoundary
from .config import StackConfig

#: handle -> the compiled unfused method of each OpaqueUnfusedBoundary (Dynamo specialises it per input form).
_BOUNDARIES: dict[int, Callable] = {}
_HANDLES = itertools.count()


def _moe(gemm2: Tensor, weights: Tensor, index: Tensor, shared: Tensor) -> MoEOutput:
    return MoEOutput(gemm2, weights, index, shared)


@torch.library.custom_op("mhc_demo::unfused_dsv41", mutates_args=())
def unfused_dsv41(
    handle: int, moe: bool, x: list[Tensor], residual: Tensor, post: Tensor, comb: Tensor, pre: Tensor,
    norm_weight: Tensor, norm_eps: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    call = _BOUNDARIES[handle]
    return call(_moe(*x) if moe else x[0], residual, post, comb, pre, norm_weight, norm_eps)


@unfused_dsv41.register_fake
def _(handle, moe, x, residual, post, comb, pre, norm_weight, norm_eps):
    return torch.empty_like(residual), residual.new_empty(residual.shape[0], residual.shape[-1])


@torch.library.custom_op("mhc_demo::unfused_glm5", mutates_args=())
def unfused_glm5(
    handle: int, moe: bool, x: list[Tensor], residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor,
    base: Tensor, norm_weight: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    call = _BOUNDARIES[handle]
    streams, layer_input, (post_out, comb_out) = call(
        _moe(*x) if moe else x[0], residual, post, comb, fn, scale, base, norm_weight
    )
    return streams, layer_input, post_out, comb_out


@unfused_glm5.register_fake
def _(handle, moe, x, residual, post, comb, fn, scale, base, norm_weight):
    m, hc = residual.shape[0], residual.shape[1]
    return (
        torch.empty_like(residual), residual.new_empty(m, residual.shape[-1]),
        post.new_empty(m, hc, 1), comb.new_empty(m, hc, hc),
    )  # fmt: skip


class OpaqueUnfusedBoundary:
    """``UnfusedBoundary``, each method compiled alone (``compile_fn``, as the model) and called through
    a ``mhc_demo::`` custom op: the same three methods the stacks call (``demo.boundaries``)."""

    def __init__(self, config: StackConfig, group, compile_fn: Callable) -> None:
        unfused = UnfusedBoundary(config, group)
        method = unfused.dsv41 if config.model == "dsv41" else unfused.glm5
        self.handle = next(_HANDLES)
        _BOUNDARIES[self.handle] = compile_fn(method)

    @staticmethod
    def _split(x) -> tuple[bool, list[Tensor]]:
        if isinstance(x, MoEOutput):
            return True, [x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx, x.shared_output]
        return False, [x]

    def dsv41(self, x, residual, post, comb, pre, norm_weight, norm_eps: float) -> tuple[Tensor, Tensor]:
        moe, parts = self._split(x)
        return torch.ops.mhc_demo.unfused_dsv41(
            self.handle, moe, parts, residual, post, comb, pre, norm_weight, norm_eps
        )

    def glm5(self, x, residual, post, comb, fn, scale, base, norm_weight):
        moe, parts = self._split(x)
        streams, layer_input, post_out, comb_out = torch.ops.mhc_demo.unfused_glm5(
            self.handle, moe, parts, residual, post, comb, fn, scale, base, norm_weight
        )
        return streams, layer_input, (post_out, comb_out)

    def glm5_join(self, pending):
        return pending
