"""Sinkhorn normalisation of the 4 x 4 residual mix, as the GLM seed's ``_sinkhorn``.

``sinkhorn4(c, eps, repeat)`` takes the 16 logits row-major (``c[4 r + k]``) and
returns the mix. The seed: per row ``a = exp(c - max) * rcp((e0 + e1) + (e2 + e3)) + eps``
(no eps inside that sum); then ``repeat`` rounds in which, from the second round on,
each row is multiplied by ``rcp(((c0 + c1) + (c2 + c3)) + eps)``, and then each column
likewise. ``mhc_core.reference.sinkhorn`` mirrors it with exact division.

The device function does the first step the same way and the rounds in scaling form:
every round only rescales rows and columns, so ``c = diag(u) a diag(v)``, and it keeps
``a`` and the reciprocals of the scales. A row's new scale is ``u / (u (a v) + eps)``, so

- row ``r``:    ``1/u_r = sum_k a_rk v_k + eps (1/u_r)``, ``u_r = rcp(1/u_r)``;
- column ``k``: ``1/v_k = sum_r u_r a_rk + eps (1/v_k)``, ``v_k = rcp(1/v_k)``;
- the mix: ``c_rk = (u_r a_rk) v_k``.

The same arithmetic in exact math, rounded differently: each half-round is a 4-term dot
and one reciprocal (one thread is latency-bound here: the seed's form also rescales all
16 entries, one multiply deeper per half-round; measured on the H200, this form took the
GLM boundary's call 0.2-0.4 us faster). ``rcp`` is ``rcp.approx`` (``mhc_core.device.fastmath``),
``exp`` the DSL's accurate one.

``SinkhornKernel`` runs the device function over ``[N, 16]`` logits, one thread a
matrix: the GPU test vehicle for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .fastmath import rcp
from .kernel import DeviceKernel
from .signature import Param, Ptr, Scalar, Signature, Stream

HC = 4


@cute.jit
def _dot_plus(a: list, b: list, extra: Float32) -> Float32:
    """``a . b + extra`` over 4 terms, 3 operations deep."""
    return (a[0] * b[0] + (extra + a[1] * b[1])) + (a[2] * b[2] + a[3] * b[3])


@cute.jit
def sinkhorn4(c: list, eps: Float32, repeat: cutlass.Constexpr[int]) -> list:
    """The 4 x 4 Sinkhorn mix of 16 row-major logits (a Python list of Float32)."""
    a = list(c)
    for r in cutlass.range_constexpr(HC):
        i = r * HC
        peak = cute.arch.fmax(cute.arch.fmax(a[i], a[i + 1]), cute.arch.fmax(a[i + 2], a[i + 3]))
        for k in cutlass.range_constexpr(HC):
            a[i + k] = cute.math.exp(a[i + k] - peak)
        inv = rcp((a[i] + a[i + 1]) + (a[i + 2] + a[i + 3]))
        for k in cutlass.range_constexpr(HC):
            a[i + k] = a[i + k] * inv + eps
    rows = [[a[r * HC + k] for k in range(HC)] for r in range(HC)]
    columns = [[a[r * HC + k] for r in range(HC)] for k in range(HC)]
    u = [Float32(1.0)] * HC
    inv_u = [Float32(1.0)] * HC
    v = [Float32(1.0)] * HC
    inv_v = [Float32(1.0)] * HC
    for iteration in cutlass.range_constexpr(repeat):
        if cutlass.const_expr(iteration > 0):
            for r in cutlass.range_constexpr(HC):
                inv_u[r] = _dot_plus(rows[r], v, eps * inv_u[r])
                u[r] = rcp(inv_u[r])
        for k in cutlass.range_constexpr(HC):
            inv_v[k] = _dot_plus(columns[k], u, eps * inv_v[k])
            v[k] = rcp(inv_v[k])
    return [(u[r] * a[r * HC + k]) * v[k] for r in range(HC) for k in range(HC)]


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
