"""The DSV4.1 collective: Lamport all-reduce fused with the mHC post-mix, the carried-pre
collapse and RMSNorm (the reference's ``_LamportMHCDeviceKernel``).

One cluster of ``cluster_size`` CTAs per token (grid ``(M, cluster_size)``). Per
fragment, with ``x`` the all-reduced sublayer output rounded to BF16:

* ``mixed_j = x * post[j] + sum_i residual[i] * comb[i, j]`` (sources in order),
  stored as ``residual_out[:, j]`` in BF16;
* ``collapse = bf16(sum_j bf16(mixed_j) * pre[j])`` (streams in order, from 0);
* ``layer_input = bf16(collapse * rsqrt(sum(collapse^2) / hidden + eps) * weight)``,
  the sum of squares reduced over the cluster through distributed shared memory.

Residual streams, weight and mixes are loaded before the PDL wait when the op
says the kernel right before is a publish (``prefetch``); the slots are re-armed
after reading and the next stage is set once per launch.

At tp = 1 a launch with ``direct`` set reads ``x`` itself after the PDL wait (the op's plain
calls: one launch, no publish, no mailbox traffic), with -0 read as +0 as a publish would
have written it, so its outputs are bitwise the mailbox path's; nothing is polled, re-armed
or moved on. The MoE finalize and the two-phase form keep the mailbox path. Once the op is poisoned
(``mhc_core.device.protocol``: an earlier kernel failed) the sums are NaN, so both outputs
are, and nothing is re-armed or moved on.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, Uint32

from mhc_core.constants import VEC_BF16
from mhc_core.device import protocol, ptx, reduce
from mhc_core.device.collective import mailbox_params
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.signature import Param, Ptr, Scalar, Signature, Stream

from .config import MHCConfig


class LamportMHCKernel(DeviceKernel):
    name = "collective"
    config_type = MHCConfig

    def signature(self) -> Signature:
        return (
            Param("residual", Ptr(BFloat16)),
            Param("post", Ptr(Float32, 4)),
            Param("comb", Ptr(Float32, 4)),
            Param("pre", Ptr(Float32, 4)),
            Param("gamma", Ptr(BFloat16)),
            Param("residual_out", Ptr(BFloat16)),
            Param("layer_input", Ptr(BFloat16)),
            Param("eps", Scalar(Float32)),
            Param("prefetch", Scalar(Int32)),
            Param("x", Ptr(BFloat16)),
            Param("direct", Scalar(Int32)),
            *mailbox_params(),
            Param("m", Scalar(Int32)),
            Param("stream", Stream()),
        )

    @cute.jit
    def __call__(
        self, residual, post, comb, pre, gamma, residual_out, layer_input, eps, prefetch, x, direct,
        mailbox, stage_state, capacity, spin_limit_ns, error_flag, m, stream,
    ):  # fmt: skip
        config = self.config
        self.kernel(
            residual, post, comb, pre, gamma, residual_out, layer_input, eps, prefetch, x, direct,
            mailbox, stage_state, capacity, spin_limit_ns, error_flag,
        ).launch(
            grid=(m, config.cluster_size, 1),
            block=(config.threads, 1, 1),
            cluster=(1, config.cluster_size, 1),
            smem=config.shared_bytes,
            stream=stream,
            use_pdl=True,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        residual: cute.Pointer,
        post: cute.Pointer,
        comb: cute.Pointer,
        pre: cute.Pointer,
        gamma: cute.Pointer,
        residual_out: cute.Pointer,
        layer_input: cute.Pointer,
        eps: Float32,
        prefetch: Int32,
        x: cute.Pointer,
        direct: Int32,
        mailbox: cute.Tensor,
        stage_state: cute.Tensor,
        capacity: Int32,
        spin_limit_ns: Int64,
        error_flag: Int64,
    ):
        config = self.config
        hc, tp, lanes, hidden, trips = config.hc, config.tp, config.rank_lanes, config.hidden, config.trips
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        cluster_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        lane = tidx % lanes
        leader = lane == 0
        base_fragment = cluster_rank * config.groups_per_cta + tidx // lanes
        mailbox_base = mailbox.iterator.toint()
        from_x = protocol.reads_x(direct, tp)

        # A direct read comes with prefetch off (the kernel before is x's producer, not a publish).
        if prefetch == Int32(0):
            cute.arch.griddepcontrol_wait()
        # Weights, residual streams and mixes: written before the publish's producer ran.
        gamma_words = cute.make_rmem_tensor(cute.make_layout((trips, 4), stride=(4, 1)), Uint32)
        stream_words = cute.make_rmem_tensor(cute.make_layout((trips, hc, 4), stride=(hc * 4, 4, 1)), Uint32)
        gamma_words.fill(Uint32(0))
        stream_words.fill(Uint32(0))
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            if (fragment < config.fragments) & leader:
                column = Int64(fragment) * VEC_BF16
                gamma_words[trip, None].store(ptx.load_u32x4(gamma.toint() + column * 2))
                for source in cutlass.range_constexpr(hc):
                    element = (Int64(token) * hc + source) * hidden + column
                    stream_words[trip, source, None].store(ptx.load_u32x4(residual.toint() + element * 2))
        post_mix = cute.make_rmem_tensor(cute.make_layout((hc,)), Float32)
        pre_mix = cute.make_rmem_tensor(cute.make_layout((hc,)), Float32)
        comb_mix = cute.make_rmem_tensor(cute.make_layout((hc, hc), stride=(hc, 1)), Float32)
        for target in cutlass.range_constexpr(hc):
            mix = Int64(token) * hc + target
            post_mix[target] = cute.arch.load((post + mix).llvm_ptr, Float32)
            pre_mix[target] = cute.arch.load((pre + mix).llvm_ptr, Float32)
            for source in cutlass.range_constexpr(hc):
                comb_mix[source, target] = cute.arch.load(
                    (comb + (Int64(token) * hc + source) * hc + target).llvm_ptr, Float32
                )

        cute.arch.griddepcontrol_wait()
        stage, poisoned = protocol.active_stage(stage_state)
        first_thread = (token == 0) & (cluster_rank == 0) & (tidx == 0)
        m, _, _ = cute.arch.grid_dim()
        state = stage_state.iterator.toint()
        prenorm_words = cute.make_rmem_tensor(cute.make_layout((trips, 4), stride=(4, 1)), Uint32)
        prenorm_words.fill(Uint32(0))
        total = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            active = fragment < config.fragments
            if from_x:
                total.fill(Float32(0.0))
                if active:
                    total.store(ptx.words_to_f32x8(protocol.load_x(x, token, Int64(fragment) * VEC_BF16, hidden)))
                if poisoned:
                    total.fill(Float32(float("nan")))  # a direct read's poison (the poll's is its own)
            else:
                # The grid's first thread also checks every rank's M (trip 0, spin bound on;
                # ``mhc_core.device.protocol``).
                poisoned = protocol.poll_and_sum(
                    total, mailbox_base, stage, token, fragment, lane, active, tp, lanes, capacity, hidden,
                    spin_limit_ns, error_flag, state, poisoned, tp > 1 and trip == 0,
                    first_thread & (spin_limit_ns > Int64(0)), m,
                )  # fmt: skip
            if active & leader:
                # The all-reduced sublayer output is BF16, as the unfused collective returns it.
                reduced = total.load().to(BFloat16).to(Float32)
                collapse = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
                collapse.fill(Float32(0.0))
                column = Int64(fragment) * VEC_BF16
                for target in cutlass.range_constexpr(hc):
                    mixed = reduced * post_mix[target]
                    for source in cutlass.range_constexpr(hc):
                        mixed = (
                            mixed
                            + ptx.words_to_f32x8(stream_words[trip, source, None].load()) * comb_mix[source, target]
                        )
                    mixed_words = ptx.f32x8_to_words(mixed)
                    element = (Int64(token) * hc + target) * hidden + column
                    ptx.store_u32x4(residual_out.toint() + element * 2, mixed_words)
                    collapse.store(collapse.load() + ptx.words_to_f32x8(mixed_words) * pre_mix[target])
                prenorm_words[trip, None].store(ptx.f32x8_to_words(collapse.load()))

        # Poisoned, or read directly: nothing consumed (no re-arm, the stage stays); a poisoned
        # kernel's outputs carry the NaN.
        healthy = (poisoned == Boolean(False)) & (from_x == Boolean(False))
        protocol.advance_stage(stage_state, stage, first_thread & healthy)
        cute.arch.griddepcontrol_launch_dependents()
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            protocol.rearm_slots(
                mailbox_base, stage, token, token, fragment, lane, (fragment < config.fragments) & healthy, 1, tp,
                lanes, capacity, hidden,
            )  # fmt: skip

        squares = cute.make_rmem_tensor(cute.make_layout((1,)), Float32)
        squares[0] = Float32(0.0)
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            if (fragment < config.fragments) & leader:
                values = ptx.words_to_f32x8(prenorm_words[trip, None].load())
                squares[0] = squares[0] + (values * values).reduce(
                    cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0
                )
        smem = cutlass.memory.SmemAllocator()
        warp_sums = smem.allocate_array(Float32, config.warps)
        cluster_sums = smem.allocate_array(Float32, config.cluster_size)
        reduce.block_to_cluster(squares, 1, warp_sums, cluster_sums, cluster_rank, config.threads, config.cluster_size)
        sum_squares = reduce.cluster_total(cluster_sums, 0, 1, config.cluster_size)
        inv_rms = cute.math.rsqrt(sum_squares / Float32(hidden) + eps, fastmath=True)
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            if (fragment < config.fragments) & leader:
                prenorm = ptx.words_to_f32x8(prenorm_words[trip, None].load())
                weight = ptx.words_to_f32x8(gamma_words[trip, None].load())
                element = Int64(token) * hidden + Int64(fragment) * VEC_BF16
                ptx.store_u32x4(layer_input.toint() + element * 2, ptx.f32x8_to_words(prenorm * inv_rms * weight))
