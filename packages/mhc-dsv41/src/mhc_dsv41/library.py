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
unless kept (``mhc_core.host.calls.layer_input``: ``q`` ``float8_e4m3fn [M, hidden]``, ``scales`` of the
format's shape, strides and allocation, ``mhc_core.fp8.Fp8Format.empty_scales``). Separate ops, so
the BF16 ones keep their schema and cost; the wrappers pick by the op's format and return a tuple.

The six ops, their fake implementations and the wrappers' bodies are generated from the parameters
below (``mhc_core.host.boundary_ops``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from mhc_core.host.boundary_ops import BoundaryOps
from mhc_core.host.calls.moe import MoEOutput  # at import: an import inside a wrapper costs each call

if TYPE_CHECKING:  # the wrappers below are typed by the op class (imported by the caller already)
    from .op import AllReduceMHC

#: The six ops, from the collective's parameters after the input (as ``AllReduceMHC.collect`` takes them).
OPS = BoundaryOps(
    "dsv41", ("residual", "post", "comb", "pre", "norm_weight", "norm_eps"), floats=("norm_eps",), moe="finalize"
)
dsv41_boundary, dsv41_boundary_fp8 = OPS.plain.bf16, OPS.plain.fp8
dsv41_finalize, dsv41_finalize_fp8 = OPS.moe.bf16, OPS.moe.fp8
dsv41_collect, dsv41_collect_fp8 = OPS.collect_form.bf16, OPS.collect_form.fp8


def boundary(
    op: AllReduceMHC, x: Tensor | MoEOutput,
    residual: Tensor, post: Tensor, comb: Tensor, pre: Tensor, norm_weight: Tensor, norm_eps: float | None = None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """``op(x, ...)`` (``op.finalize`` for a ``MoEOutput`` x) of an ``AllReduceMHC`` through the custom ops
    (``norm_eps`` None: the op's): what the op's call returns, ``(residual_out, layer_input)`` or, with an
    FP8 layer input, ``(residual_out, q, scales[, layer_input])``."""
    norm_eps = op.norm_eps if norm_eps is None else norm_eps
    return OPS.boundary(op, x, residual, post, comb, pre, norm_weight, norm_eps)


def collect(
    op: AllReduceMHC,
    residual: Tensor, post: Tensor, comb: Tensor, pre: Tensor, norm_weight: Tensor, norm_eps: float | None = None,
) -> tuple[Tensor, ...]:  # fmt: skip
    """``op.collect(...)`` through the custom ops (after ``mhc_core.host.library.publish_input``;
    ``norm_eps`` None: the op's), returning as ``boundary`` does."""
    norm_eps = op.norm_eps if norm_eps is None else norm_eps
    return OPS.collect(op, residual, post, comb, pre, norm_weight, norm_eps)
