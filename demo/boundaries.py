"""The pluggable sublayer boundaries: unfused (what an engine runs today), fused (the ``torch.ops.mhc`` ops)
and emulated (a conforming kernel built from the FP64 reference, for the logit tolerance).

Every boundary has the same three methods, which the stacks in ``demo.model`` call:

* ``dsv41(x, residual, post, comb, pre, norm_weight, norm_eps) -> (residual_out, layer_input)``;
* ``glm5(x, residual, post, comb, fn, scale, base, norm_weight) -> (residual_out, layer_input,
  pending)`` and ``glm5_join(pending) -> (post_out, comb_out)``: the stack joins right before the
  next boundary (and once after the LM head), so a fused op's side-stream mixes overlap the
  sublayer in between.

``x`` is a sublayer's TP-partial output: a ``[M, hidden]`` BF16 tensor, or a ``mhc_core.MoEOutput``
whose top-k reduction is still open.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from mhc_core import MoEOutput
from mhc_dsv41.bench.baseline import boundary as dsv41_boundary
from mhc_glm5.bench.baseline import boundary_with as glm5_boundary

from . import reference, tolerance
from .config import StackConfig

BF16 = torch.bfloat16
#: How far into its bound the emulated kernel moves each element: all the way, less FP32 noise in the ratio.
REACH = 1 - 2.0**-10


def finalize(moe: MoEOutput) -> Tensor:
    """The MoE finalize an engine runs in torch: ``bf16(shared + sum_k weight_k * gemm2[index_k])``, FP32 sums."""
    index = moe.expanded_idx_to_permuted_idx.long()
    rows = moe.gemm2_permuted[index.clamp(min=0)].float()  # [M, top_k, hidden]
    weights = torch.where(index >= 0, moe.expert_weights.float(), 0.0).unsqueeze(-1)
    return (moe.shared_output.float() + (weights * rows).sum(1)).to(BF16)


class UnfusedBoundary:
    """Finalize (MoE) and all-reduce the sublayer output, then the model's torch boundary (the benchmarks'
    baseline: ``mhc_dsv41.bench.baseline`` / ``mhc_glm5.bench.baseline``).

    The all-reduce is ``torch.distributed.all_reduce`` (NCCL) at tp > 1 (``group``), none at tp 1;
    under ``torch.compile`` it traces to the functional collective.
    """

    def __init__(self, config: StackConfig, group=None) -> None:
        self.config, self.group = config, group
        self.constants = {**config.mixes.constants(), "norm_eps": config.norm_eps}

    def reduce(self, x) -> Tensor:
        if isinstance(x, MoEOutput):
            x = finalize(x)
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def dsv41(self, x, residual, post, comb, pre, norm_weight, norm_eps: float) -> tuple[Tensor, Tensor]:
        return dsv41_boundary(self.reduce(x), residual, post, comb, pre, norm_weight, norm_eps)

    def glm5(self, x, residual, post, comb, fn, scale, base, norm_weight):
        streams, post_out, comb_out, layer_input = glm5_boundary(
            self.reduce(x), residual, post, comb, fn, scale, base, norm_weight, **self.constants
        )
        return streams, layer_input, (post_out, comb_out)

    def glm5_join(self, pending):
        return pending


class FusedBoundary:
    """The fused op through its ``torch.ops.mhc`` custom ops (``mhc_dsv41.library`` / ``mhc_glm5.library``).

    ``op``: one ``AllReduceMHC`` / ``AllReduceMhcBoundary`` for every boundary of the model (the
    contract: one instance per model, called for each boundary in order). A ``MoEOutput`` goes
    through the op's finalize form: the top-k reduction and the shared expert fold into its publish.
    GLM's ``pending`` is the boundary's ``residual_out``: the join op orders itself after it.
    """

    def __init__(self, op) -> None:
        self.op = op

    def dsv41(self, x, residual, post, comb, pre, norm_weight, norm_eps: float) -> tuple[Tensor, Tensor]:
        from mhc_dsv41 import library

        return library.boundary(self.op, x, residual, post, comb, pre, norm_weight, norm_eps)

    def glm5(self, x, residual, post, comb, fn, scale, base, norm_weight):
        from mhc_glm5 import library

        streams, layer_input = library.boundary(self.op, x, residual, post, comb, fn, scale, base, norm_weight)
        return streams, layer_input, streams

    def glm5_join(self, pending):
        from mhc_glm5 import library

        return library.join(self.op, pending)


class EmulatedBoundary:
    """A kernel that conforms to ``demo.tolerance``'s per-boundary bounds by construction.

    Each output is the FP64 reference (``demo.reference``, at this boundary's own inputs) moved by
    its full bound with a random sign per element, rounded where the kernel rounds (an element the
    rounding would carry past its bound stays where it was); the collapse, norm and GLM mixes are
    taken from the moved streams, as the kernel takes them from its own. Eager only (it gathers
    partials at tp > 1). ``seed``: the signs' generator, the same on every rank.
    """

    def __init__(self, config: StackConfig, *, seed: int, device, group=None) -> None:
        self.config, self.group = config, group
        self.generator = torch.Generator(device)
        self.generator.manual_seed(seed)

    def _signs(self, like: Tensor) -> Tensor:
        bits = torch.randint(0, 2, like.shape, generator=self.generator, device=like.device)
        return bits.to(torch.float32) * 2 - 1

    def _move(self, value: Tensor, bound: Tensor) -> Tensor:
        bound = bound.float().expand_as(value)
        moved = (value.float() + self._signs(value) * bound * REACH).to(value.dtype)
        inside = (moved.float() - value.float()).abs() <= bound
        return torch.where(inside, moved, value)

    def _streams(self, x, residual, post, comb) -> Tensor:
        reduced = reference.reduced(x, self.group)
        expected = reference.post_mix(reduced.value, residual, post, comb)
        bound = tolerance.post_mix_bound(reduced.value, residual, post, comb, expected, reduced.error)
        return self._move(expected, bound)

    def dsv41(self, x, residual, post, comb, pre, norm_weight, norm_eps: float) -> tuple[Tensor, Tensor]:
        streams = self._streams(x, residual, post, comb)
        collapse, layer_input = reference.dsv41_collapse(streams, pre, norm_weight, norm_eps)
        bound = tolerance.dsv41_input_bound(streams, pre, norm_weight, norm_eps, collapse, layer_input)
        return streams, self._move(layer_input, bound)

    def glm5(self, x, residual, post, comb, fn, scale, base, norm_weight):
        config = self.config
        streams = self._streams(x, residual, post, comb)
        ref = reference.glm5_mixes(streams, fn, scale, base, norm_weight, config.mixes, config.norm_eps)
        bounds = tolerance.glm5_bounds(
            streams, scale, norm_weight, config.norm_eps, config.mixes.post_mult, config.mixes.sinkhorn_repeat, ref
        )
        moved = {name: self._move(ref[name], bounds[name]) for name in ("layer_input", "post_out", "comb_out")}
        return streams, moved["layer_input"], (moved["post_out"], moved["comb_out"])

    def glm5_join(self, pending):
        return pending
