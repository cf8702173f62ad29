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
unless kept (``mhc_core.host.calls.layer_input``: ``q`` ``float8_e4m3fn [M, hidden]``, ``scales`` of the
format's shape, strides and allocation, ``mhc_core.fp8.Fp8Format.empty_scales``); ``mhc::glm5_join``
is the same for both. Separate ops, so that the BF16 ones keep their schema and cost; the wrappers
pick by the op's format and return a tuple.

The six boundary ops, their fake implementations and the wrappers' bodies are generated from the
parameters below (``mhc_core.host.boundary_ops``); the join is written here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mhc_core.host import library
from mhc_core.host.boundary_ops import BoundaryOps
from mhc_core.host.calls.moe import MoEOutput  # at import: an import inside a wrapper costs each call

if TYPE_CHECKING:  # the wrappers below are typed by the op class (imported by the caller already)
    from .op import AllReduceMhcBoundary

from .config import HC

#: Per handle, the side-stream outputs of the last boundary call, until its join.
_UNJOINED: dict[int, tuple[Tensor, Tensor]] = {}


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


#: The six boundary ops, from the boundary's parameters after the input (as
#: ``AllReduceMhcBoundary.collect`` takes them); each keeps its call's side outputs for the join.
OPS = BoundaryOps(
    "glm5", ("residual", "post", "comb", "fn", "scale", "base", "norm_weight"), moe="boundary_moe", returned=_fused
)
glm5_boundary, glm5_boundary_fp8 = OPS.plain.bf16, OPS.plain.fp8
glm5_boundary_moe, glm5_boundary_moe_fp8 = OPS.moe.bf16, OPS.moe.fp8
glm5_collect, glm5_collect_fp8 = OPS.collect_form.bf16, OPS.collect_form.fp8


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
    op: AllReduceMhcBoundary, x: Tensor | MoEOutput,
    residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_weight: Tensor,
) -> tuple[Tensor, ...]:  # fmt: skip
    """``op(x, ...)`` of an ``AllReduceMhcBoundary`` through the custom ops (``x``: a tensor or a
    ``MoEOutput``): ``(residual_out, layer_input)``, or with an FP8 layer input ``(residual_out, q,
    scales[, layer_input])``; ``join`` gives ``(post_out, comb_out)``."""
    return OPS.boundary(op, x, residual, post, comb, fn, scale, base, norm_weight)


def collect(
    op: AllReduceMhcBoundary,
    residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_weight: Tensor,
) -> tuple[Tensor, ...]:  # fmt: skip
    """``op.collect(...)`` through the custom ops (after ``mhc_core.host.library.publish_input``),
    returning as ``boundary`` does."""
    return OPS.collect(op, residual, post, comb, fn, scale, base, norm_weight)


def join(op: AllReduceMhcBoundary, residual_out: Tensor) -> tuple[Tensor, Tensor]:
    """``(post_out, comb_out)`` of the op's last boundary call, once the current stream waits for them."""
    if library.eager(op, residual_out):
        with op._lock:
            return _joined(op.handle, op)
    return torch.ops.mhc.glm5_join(op.state, op.handle, residual_out)
