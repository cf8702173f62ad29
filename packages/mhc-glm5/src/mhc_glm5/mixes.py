"""The side-stream mixes kernel (the reference's ``_MixesDeviceKernel``): one thread per token
turns a boundary's raw mixes into the next boundary's post-mix and residual mix.

``post_out[j] = sigmoid(raw[4 + j] * scale[1] + base[4 + j]) * post_mult`` and
``comb_out = sinkhorn(raw[8 + k] * scale[2] + base[8 + k], k = 0..15)``
(``mhc_core.device.sinkhorn``). The grid has ``ceil(M / threads)`` CTAs: no one-CTA limit
on ``max_num_tokens``.

The op launches it alongside the boundary: each thread polls its token's row of the
hand-off buffer (``mhc_core.device.handoff``), where the boundary writes the raw mixes, re-arms
it and keeps a copy in ``raw_out`` (the op's ``raw_mixes``); ``state`` is the op's stage state,
whose error word a hand-off timeout sets. It does not read the error
word: a poisoned boundary still hands off its (NaN) raw mixes, so these outputs are NaN too.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from mhc_core.device import handoff
from mhc_core.device.fastmath import sigmoid
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.signature import Param, Ptr, Scalar, Signature, Stream
from mhc_core.device.sinkhorn import sinkhorn4

from .config import HC, MIX


@dataclass(frozen=True, slots=True)
class MixesConfig:
    hc_eps: float
    post_mult: float
    sinkhorn_repeat: int
    threads: int = 128


class MixesKernel(DeviceKernel):
    name = "mixes"
    config_type = MixesConfig

    def signature(self) -> Signature:
        return (
            Param("mixes", Ptr(Float32, 16)),
            Param("raw_out", Ptr(Float32, 16)),
            Param("scale", Ptr(Float32, 4)),
            Param("base", Ptr(Float32, 4)),
            Param("post_out", Ptr(Float32, 4)),
            Param("comb_out", Ptr(Float32, 4)),
            Param("spin_limit_ns", Scalar(Int64)),
            Param("error_flag", Scalar(Int64)),
            Param("state", Scalar(Int64)),
            Param("m", Scalar(Int32)),
            Param("stream", Stream()),
        )

    @cute.jit
    def __call__(self, mixes, raw_out, scale, base, post_out, comb_out, spin_limit_ns, error_flag, state, m, stream):
        threads = self.config.threads
        self.kernel(mixes, raw_out, scale, base, post_out, comb_out, spin_limit_ns, error_flag, state, m).launch(
            grid=((m + threads - 1) // threads, 1, 1), block=(threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mixes: cute.Pointer,
        raw_out: cute.Pointer,
        scale: cute.Pointer,
        base: cute.Pointer,
        post_out: cute.Pointer,
        comb_out: cute.Pointer,
        spin_limit_ns: Int64,
        error_flag: Int64,
        state: Int64,
        m: Int32,
    ):
        config = self.config
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        token = block * config.threads + tidx
        rows = mixes.toint()
        # The weights do not depend on the boundary: load them while it runs.
        post_scale = cute.arch.load((scale + 1).llvm_ptr, Float32)
        comb_scale = cute.arch.load((scale + 2).llvm_ptr, Float32)
        bias = [cute.arch.load((base + HC + k).llvm_ptr, Float32) for k in range(MIX - HC)]
        raw = cute.make_rmem_tensor(cute.make_layout((MIX,)), Float32)
        arrived = Boolean(False)
        if token < m:
            arrived = handoff.wait_row(raw, rows, token, MIX, spin_limit_ns, error_flag, state)
            handoff.rearm_row(rows, token, MIX)
            handoff.write_row(raw_out.toint(), token, raw, MIX)
        # Tokens arrive at different times; a warp that ran each one's Sinkhorn as it arrived
        # would run them one after another (diverged). Wait for the warp's last one.
        cute.arch.sync_warp()
        if arrived:
            self.mix(raw, post_scale, comb_scale, bias, post_out, comb_out, token)

    @cute.jit
    def mix(
        self,
        raw: cute.Tensor,
        post_scale: Float32,
        comb_scale: Float32,
        bias: list,
        post_out: cute.Pointer,
        comb_out: cute.Pointer,
        token: Int32,
    ):
        """``raw`` is the token's 24 raw mixes, ``bias`` is ``base[4:24]``."""
        config = self.config
        for j in cutlass.range_constexpr(HC):
            value = sigmoid(raw[HC + j] * post_scale + bias[j]) * Float32(config.post_mult)
            cute.arch.store((post_out + Int64(token) * HC + j).llvm_ptr, value)
        logits = [raw[2 * HC + k] * comb_scale + bias[HC + k] for k in range(HC * HC)]
        mix = sinkhorn4(logits, Float32(config.hc_eps), config.sinkhorn_repeat)
        for k in cutlass.range_constexpr(HC * HC):
            cute.arch.store((comb_out + Int64(token) * HC * HC + k).llvm_ptr, mix[k])
