"""Every quotient the ``fp32-g128`` quantisation can divide, two ways: ``div.rn.f32`` and the shared
reciprocal with ``div.rn``'s fast path (``ptx.rcp_refined_f32`` / ``ptx.div_refined_f32``, what
``mhc_core.device.quant.quantize_fragment_divide`` takes for a normal scale), for the GPU test.

Thread ``i`` takes the group absmax with BF16 bits ``i // CHUNKS`` (every finite non-negative BF16;
0 floors to ``1e-10``), its scale as ``quant.group_scale`` computes it, and a ``1 / CHUNKS`` share
of the BF16 values ``x`` with ``|x| <= absmax`` (every value a group with that absmax can hold). It
counts the E4M3 codes that differ, and the FP32 quotients that differ where ``|x / s| >= 2^-11``
(below, every code is a signed zero whichever way it divides).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from mhc_core.device import ptx, quant
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.signature import Param, Ptr, Scalar, Signature, Stream

#: BF16 bit patterns, and the shares of them one thread takes.
BF16_PATTERNS = 1 << 16
CHUNKS = 16
#: The largest finite BF16's bits (0x7F80 is infinity): the absmax values run 0 ..= this.
BF16_MAX_FINITE = 0x7F7F
THREADS = 128
#: FP32 bits of 2^-11: smaller quotients all give a signed zero code (E4M3's least is 2^-9).
TINY_QUOTIENT_BITS = 0x3A000000
MAGNITUDE = 0x7FFF
SIGN_FREE = 0x7FFFFFFF


@dataclass(frozen=True)
class DivisionConfig:
    chunks: int = CHUNKS


class DivisionKernel(DeviceKernel):
    name = "fp8_division"
    config_type = DivisionConfig

    def signature(self) -> Signature:
        return (Param("out", Ptr(Int32, 4)), Param("n", Scalar(Int32)), Param("stream", Stream()))

    @cute.jit
    def __call__(self, out, n, stream):
        self.kernel(out, n).launch(grid=((n + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Pointer, n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        i = block * THREADS + tidx
        if i < n:
            chunks = self.config.chunks
            absmax = i // chunks
            share = BF16_PATTERNS // chunks
            scale = quant.group_scale(Uint32(absmax) << Uint32(16))
            reciprocal = ptx.rcp_refined_f32(scale)
            codes = Int32(0)
            quotients = Int32(0)
            first = (i % chunks) * share
            for pattern in range(first, first + share):
                if pattern & MAGNITUDE <= absmax:
                    x = ptx.f32_from_bits(Uint32(pattern) << Uint32(16))
                    exact = ptx.div_rn_f32(x, scale)
                    fast = ptx.div_refined_f32(x, scale, reciprocal)
                    if ptx.cvt_e4m3x2(exact, exact) != ptx.cvt_e4m3x2(fast, fast):
                        codes = codes + Int32(1)
                    exact_bits = ptx.f32_to_bits(exact)
                    if (exact_bits & Uint32(SIGN_FREE) >= Uint32(TINY_QUOTIENT_BITS)) & (
                        exact_bits != ptx.f32_to_bits(fast)
                    ):
                        quotients = quotients + Int32(1)
            cute.arch.store((out + Int64(i) * 2).llvm_ptr, codes)
            cute.arch.store((out + (Int64(i) * 2 + 1)).llvm_ptr, quotients)
