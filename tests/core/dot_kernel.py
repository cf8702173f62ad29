"""A one-thread kernel around ``ptx.dot_bf16x8``, for the PTX and GPU tests of both variants."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from mhc_core.device import ptx
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.signature import Param, Ptr, Scalar, Signature, Stream


class DotKernel(DeviceKernel):
    """``out[i] = dot(a[i], b[i])`` over ``n`` pairs of 8-element BF16 fragments."""

    name = "dot"

    def __init__(self, mixed_fma: bool) -> None:
        super().__init__(mixed_fma)

    def signature(self) -> Signature:
        return (
            Param("a", Ptr(BFloat16)),
            Param("b", Ptr(BFloat16)),
            Param("out", Ptr(Float32, 4)),
            Param("n", Scalar(Int32)),
            Param("stream", Stream()),
        )

    @cute.jit
    def __call__(self, a, b, out, n, stream):
        self.kernel(a, b, out, n).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, a: cute.Pointer, b: cute.Pointer, out: cute.Pointer, n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        i = block * 128 + tidx
        if i < n:
            offset = Int64(i) * 16
            value = ptx.dot_bf16x8(ptx.load_u32x4(a.toint() + offset), ptx.load_u32x4(b.toint() + offset), self.config)
            cute.arch.store((out + i).llvm_ptr, value)
