"""One thread per row around ``mhc_core.device.handoff``, for the PTX and GPU tests of both sides."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from mhc_core.device import handoff
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.signature import Param, Ptr, Scalar, Signature, Stream

WIDTH = 8


@dataclass(frozen=True)
class HandoffConfig:
    #: "write": ``rows[i] = values[i]`` through ``write_row``; "take": ``out[i] = wait_row(rows[i])``,
    #: then ``rearm_row``.
    role: str


class HandoffKernel(DeviceKernel):
    name = "handoff"
    config_type = HandoffConfig

    def signature(self) -> Signature:
        return (
            Param("values", Ptr(Float32)),
            Param("rows", Ptr(Float32)),
            Param("out", Ptr(Float32)),
            Param("spin_limit_ns", Scalar(Int64)),
            Param("error_flag", Scalar(Int64)),
            Param("state", Scalar(Int64)),
            Param("n", Scalar(Int32)),
            Param("stream", Stream()),
        )

    @cute.jit
    def __call__(self, values, rows, out, spin_limit_ns, error_flag, state, n, stream):
        self.kernel(values, rows, out, spin_limit_ns, error_flag, state, n).launch(
            grid=((n + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        values: cute.Pointer,
        rows: cute.Pointer,
        out: cute.Pointer,
        spin_limit_ns: Int64,
        error_flag: Int64,
        state: Int64,
        n: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        i = block * 128 + tidx
        if i < n:
            if cutlass.const_expr(self.config.role == "write"):
                row = [cute.arch.load((values + Int64(i) * WIDTH + k).llvm_ptr, Float32) for k in range(WIDTH)]
                handoff.write_row(rows.toint(), i, row, WIDTH)
            else:
                taken = cute.make_rmem_tensor(cute.make_layout((WIDTH,)), Float32)
                if handoff.wait_row(taken, rows.toint(), i, WIDTH, spin_limit_ns, error_flag, state):
                    handoff.write_row(out.toint(), i, taken, WIDTH)
                handoff.rearm_row(rows.toint(), i, WIDTH)
