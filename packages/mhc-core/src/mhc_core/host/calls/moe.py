"""The unfinalized MoE output a finalize publish reduces on the fly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEOutput:
    """A MoE layer's output with the routed top-k reduction still open.

    Attributes:
        gemm2_permuted: ``[rows, hidden]`` BF16 unweighted GEMM2 output, in the MoE's
            permuted row order (TP-partial).
        expert_weights: ``[M, top_k]`` FP32 or BF16 routing weights, already scaled.
        expanded_idx_to_permuted_idx: ``[M, top_k]`` int32 row of each route in
            ``gemm2_permuted``, -1 for an expert this rank does not hold.
        shared_output: ``[M, hidden]`` BF16 shared-expert output (TP-partial).

    Contract (not checkable before launch without a sync): every index is -1 or
    in ``[0, rows)``. Ops built with ``check_routes=True`` verify it on the device
    and raise ``RouteIndexError`` at the next call.
    """

    gemm2_permuted: torch.Tensor
    expert_weights: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor
    shared_output: torch.Tensor


#: The MoE expert output's fields in the order a program takes them (the first binds M).
MOE_FIELDS = ("shared_output", "gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx")
