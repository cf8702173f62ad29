"""Sinkhorn normalisation of the 4 x 4 residual mix, as the GLM seed's ``_sinkhorn``.

``sinkhorn4(c, eps, repeat)`` takes the 16 logits row-major (``c[4 r + k]``) and
returns the mix: per row ``c = exp(c - max) * rcp((e0 + e1) + (e2 + e3)) + eps``
(no eps inside that sum); then ``repeat`` rounds in which, from the second round
on, each row is multiplied by ``rcp(((c0 + c1) + (c2 + c3)) + eps)``, and then each
column likewise. ``rcp`` is ``rcp.approx`` (``mhc_core.fastmath``), ``exp`` the
DSL's accurate one; ``mhc_core.reference.sinkhorn`` mirrors the order with exact
division.

``SinkhornKernel`` runs the device function over ``[N, 16]`` logits, one thread a
matrix: the GPU test vehicle for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .compiler import DeviceKernel
from .fastmath import rcp
from .signature import Param, Ptr, Scalar, Signature, Stream

HC = 4


@cute.jit
def sinkhorn4(c: list, eps: Float32, repeat: cutlass.Constexpr[int]) -> list:
    """The 4 x 4 Sinkhorn mix of 16 row-major logits (a Python list of Float32)."""
    c = list(c)
    for r in cutlass.range_constexpr(HC):
        i = r * HC
        peak = cute.arch.fmax(cute.arch.fmax(c[i], c[i + 1]), cute.arch.fmax(c[i + 2], c[i + 3]))
        for k in cutlass.range_constexpr(HC):
            c[i + k] = cute.math.exp(c[i + k] - peak)
        inv = rcp((c[i] + c[i + 1]) + (c[i + 2] + c[i + 3]))
        for k in cutlass.range_constexpr(HC):
            c[i + k] = c[i + k] * inv + eps
    for iteration in cutlass.range_constexpr(repeat):
        if cutlass.const_expr(iteration > 0):
            for r in cutlass.range_constexpr(HC):
                i = r * HC
                inv = rcp((c[i] + c[i + 1]) + (c[i + 2] + c[i + 3]) + eps)
                for k in cutlass.range_constexpr(HC):
                    c[i + k] = c[i + k] * inv
        for k in cutlass.range_constexpr(HC):
            inv = rcp((c[k] + c[HC + k]) + (c[2 * HC + k] + c[3 * HC + k]) + eps)
            for r in cutlass.range_constexpr(HC):
                c[r * HC + k] = c[r * HC + k] * inv
    return c


@dataclass(frozen=True, slots=True)
class SinkhornConfig:
    repeat: int
    threads: int = 128


class SinkhornKernel(DeviceKernel):
    """``out[n] = sinkhorn4(logits[n], eps, repeat)`` for ``[N, 16]`` FP32 logits."""

    name = "sinkhorn"
    config_type = SinkhornConfig

    def signature(self) -> Signature:
        return (
            Param("logits", Ptr(Float32, 4)),
            Param("out", Ptr(Float32, 4)),
            Param("eps", Scalar(Float32)),
            Param("n", Scalar(Int32)),
            Param("stream", Stream()),
        )

    @cute.jit
    def __call__(self, logits, out, eps, n, stream):
        threads = self.config.threads
        self.kernel(logits, out, eps, n).launch(
            grid=((n + threads - 1) // threads, 1, 1), block=(threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, logits: cute.Pointer, out: cute.Pointer, eps: Float32, n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        matrix = block * self.config.threads + tidx
        if matrix < n:
            row = Int64(matrix) * (HC * HC)
            c = [cute.arch.load((logits + row + k).llvm_ptr, Float32) for k in range(HC * HC)]
            c = sinkhorn4(c, eps, self.config.repeat)
            for k in cutlass.range_constexpr(HC * HC):
                cute.arch.store((out + row + k).llvm_ptr, c[k])
