"""The grouped GLM-5.3 boundary for large batches (the reference's ``_GroupBoundaryDeviceKernel``).

``tokens`` tokens per cluster share one load of the ``fn`` rows in registers and
both cluster reductions. Before the PDL wait (when ``prefetch``) every token's
residual fragments and its post / comb mixes are staged in shared memory; then,
still before the wait (``mhc_glm5.boundary``), every token's slots are polled
together (a repeated token reads its slot again before any slot is re-armed). The
wait comes after the cluster reduction, before ``residual_out`` is stored. A short
last group repeats its last token; the repeats rewrite the same outputs, and the raw
mixes are written once per token.

Per token the math is ``mhc_glm5.boundary``'s, with each lane's 25 GEMV /
sum-of-squares terms summed over the warp by one reduce-scatter (lane ``i`` ends
with value ``i``): a different FP32 order than the one-token kernel, so a token's
raw mixes may differ between the two by a few FP32 ulps of the terms.

Shared memory (``mhc_glm5.config.grouped_shared_bytes``) passes 48 KB from about 9
tokens per cluster at hidden 4096; the DSL opts every kernel into the device's
maximum dynamic shared memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from mhc_core.constants import NAN_BF16_PAIR, VEC_BF16, WARP_SIZE
from mhc_core.device import protocol, ptx, reduce

from . import stages
from .boundary import (
    BoundaryArgs,
    BoundaryConfig,
    BoundaryKernel,
    collapse_streams,
    gemv_partials,
    inverse_rms,
    load_fn_rows,
    mixes_rstd,
    pre_mix,
    write_raw_mixes,
)
from .config import HC, MIX_INPUTS, VALUES, grouped_shared_bytes


class GroupBoundaryKernel(BoundaryKernel):
    name = "boundary_grouped"
    config_type = BoundaryConfig

    def __init__(self, config: BoundaryConfig) -> None:
        if config.tokens < 2:
            raise ValueError(f"tokens: expected >= 2 for the grouped boundary, got {config.tokens}")
        if VALUES > WARP_SIZE:
            raise ValueError("the 25 reduced values must fit one warp reduce-scatter")
        super().__init__(config)

    def shared_bytes(self) -> int:
        return grouped_shared_bytes(self.config.hidden, self.config.cluster_size, self.config.tokens)

    @cute.jit
    def body(self, args: BoundaryArgs):
        config = self.config
        hidden, tp, cluster, tokens = config.hidden, config.tp, config.cluster_size, config.tokens
        groups, warps, threads = config.groups_per_cta, config.warps, config.threads
        waves = protocol.rank_waves(tp, HC)
        tidx, _, _ = cute.arch.thread_idx()
        group, _, _ = cute.arch.block_idx()
        cluster_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        warp = cute.arch.warp_idx()
        lane = tidx % HC  # source rank lane while polling, stream afterwards
        local = tidx // HC
        fragment = cluster_rank * groups + local
        column = Int64(fragment) * VEC_BF16
        first = group * tokens
        last = args.m - 1

        from_x = protocol.reads_x(args.direct, tp)

        smem = cutlass.memory.SmemAllocator()
        staged = smem.allocate_array(Uint32, tokens * HC * groups * 4, byte_alignment=16)
        mix_inputs = smem.allocate_array(Float32, tokens * MIX_INPUTS)
        warp_sums = smem.allocate_array(Float32, tokens * warps * VALUES)
        cluster_sums = smem.allocate_array(Float32, tokens * cluster * VALUES)
        totals = smem.allocate_array(Float32, tokens * VALUES)
        warp_sums2 = smem.allocate_array(Float32, tokens * warps)
        cluster_sums2 = smem.allocate_array(Float32, tokens * cluster)

        if (args.prefetch == Int32(0)) | from_x:
            cute.arch.griddepcontrol_wait()
        # The stage and the error word first: the poll needs the stage, and a direct read's poison
        # select the error word, so their load is in flight while the prologue is issued.
        stage, poisoned = protocol.stage_before_wait(args.stage_state)
        # The post-mix's inputs are requested before fn (``mhc_glm5.boundary``).
        kept = cute.make_rmem_tensor(cute.make_layout((tokens, waves, 4), stride=(waves * 4, 4, 1)), Uint32)
        if from_x:
            for t in cutlass.range_constexpr(tokens):
                kept[t, 0, None].store(protocol.load_x(args.x, cutlass.min(first + t, last), column, hidden))
        sources = cute.make_rmem_tensor(cute.make_layout((tokens, 4), stride=(4, 1)), Uint32)
        for t in cutlass.range_constexpr(tokens):
            element = (Int64(cutlass.min(first + t, last)) * HC + Int64(lane)) * hidden + column
            sources[t, None].store(ptx.load_u32x4(args.residual.toint() + element * 2))
        fn_rows = load_fn_rows(args.fn, lane, column, hidden)
        gamma_words = ptx.load_u32x4(args.gamma.toint() + column * 2)
        for t in cutlass.range_constexpr(tokens):
            ptx.store_shared_u32x4(staged + ((t * HC + lane) * groups + local) * 4, sources[t, None].load())
        stages.stage_mix_inputs(args.post, args.comb, mix_inputs, first, last, tokens, threads, False)
        cute.arch.barrier()

        # Polled before the PDL wait; the wait comes before the first output store (``boundary``).
        polled = Boolean(True)
        if from_x:
            polled = Boolean(False)
            if poisoned:
                kept.fill(Uint32(NAN_BF16_PAIR))
        else:
            mailbox_base = args.mailbox.iterator.toint()
            counter = (group == 0) & (cluster_rank == 0) & (tidx == 0) & (args.spin_limit_ns > Int64(0))
            poisoned = protocol.poll_slots(
                kept, mailbox_base, stage, first, last, fragment, lane, True, tokens, tp, HC, args.capacity, hidden,
                args.spin_limit_ns, args.error_flag, args.stage_state.iterator.toint(), poisoned, 1, 0, tp > 1, counter,
                args.m,
            )  # fmt: skip
            # Lanes leave the poll at different times; the shuffles below need the warp converged.
            cute.arch.sync_warp()
            reduced = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
            for t in cutlass.range_constexpr(tokens):
                reduced.store(protocol.lane_sum(kept, t, waves))
                protocol.sum_over_lanes(reduced, HC)
                # The all-reduced sublayer output is BF16, as the collective returns it.
                kept[t, 0, None].store(ptx.f32x8_to_words(reduced.load()))
            protocol.rearm_slots(
                mailbox_base, stage, first, last, fragment, lane, poisoned == Boolean(False), tokens, tp, HC,
                args.capacity, hidden,
            )  # fmt: skip
        cute.arch.griddepcontrol_launch_dependents()

        for t in cutlass.range_constexpr(tokens):
            inputs = mix_inputs + t * MIX_INPUTS
            mixed = ptx.words_to_f32x8(kept[t, 0, None].load()) * cute.arch.load((inputs + lane).llvm_ptr, Float32)
            for source in cutlass.range_constexpr(HC):
                words = ptx.load_shared_u32x4(staged + ((t * HC + source) * groups + local) * 4)
                mixed = mixed + ptx.words_to_f32x8(words) * cute.arch.load(
                    (inputs + HC + source * HC + lane).llvm_ptr, Float32
                )
            stream_words = ptx.f32x8_to_words(mixed)
            kept[t, 0, None].store(stream_words)
            partial = gemv_partials(lambda row: fn_rows[row, None].load(), stream_words, config.mixed_fma)
            for _ in cutlass.range_constexpr(WARP_SIZE - VALUES):
                partial.append(Float32(0.0))
            total = reduce.warp_reduce_scatter(partial)
            if cute.arch.lane_idx() < Int32(VALUES):
                slot = warp_sums + (t * warps + warp) * VALUES + cute.arch.lane_idx()
                cute.arch.store(slot.llvm_ptr, total)
        cute.arch.barrier()

        # Every CTA's per-token sums into every peer's slot, then the totals.
        pairs = tokens * VALUES
        for trip in cutlass.range_constexpr(-(-pairs // threads)):
            index = tidx + trip * threads
            if index < Int32(pairs):
                t = index // VALUES
                v = index % VALUES
                total = Float32(0.0)
                for w in cutlass.range_constexpr(warps):
                    total = total + cute.arch.load((warp_sums + (t * warps + w) * VALUES + v).llvm_ptr, Float32)
                for peer in cutlass.range_constexpr(cluster):
                    ptx.store_to_peer_f32(cluster_sums + (t * cluster + cluster_rank) * VALUES + v, Int32(peer), total)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        for trip in cutlass.range_constexpr(-(-pairs // threads)):
            index = tidx + trip * threads
            if index < Int32(pairs):
                t = index // VALUES
                v = index % VALUES
                cute.arch.store(
                    (totals + index).llvm_ptr,
                    reduce.cluster_total(cluster_sums + t * cluster * VALUES, v, VALUES, cluster),
                )
        cute.arch.barrier()

        cute.arch.griddepcontrol_wait()
        for t in cutlass.range_constexpr(tokens):
            output = (Int64(cutlass.min(first + t, last)) * HC + Int64(lane)) * hidden + column
            ptx.store_u32x4(args.residual_out.toint() + output * 2, kept[t, 0, None].load())
        hc_eps = Float32(config.hc_eps)
        for t in cutlass.range_constexpr(tokens):
            rstd = mixes_rstd(totals + t * VALUES, hidden, config.rms_eps)
            if (cluster_rank == 0) & (tidx == Int32(t)) & (first + t <= last):
                write_raw_mixes(totals + t * VALUES, rstd, args.mixes_out, first + t)
            mix = cute.arch.load((totals + t * VALUES + lane).llvm_ptr, Float32) * rstd
            prenorm_words = collapse_streams(kept[t, 0, None].load(), pre_mix(mix, args.scale, args.base, lane, hc_eps))
            kept[t, 0, None].store(prenorm_words)
            square = Float32(0.0)
            if lane == 0:
                square = ptx.dot_bf16x8(prenorm_words, prenorm_words, config.mixed_fma)
            square = reduce.warp_sum(square)
            if cute.arch.lane_idx() == 0:
                cute.arch.store((warp_sums2 + t * warps + warp).llvm_ptr, square)
        cute.arch.barrier()
        if tidx < Int32(tokens * cluster):
            t = tidx // cluster
            peer = tidx % cluster
            total = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                total = total + cute.arch.load((warp_sums2 + t * warps + w).llvm_ptr, Float32)
            ptx.store_to_peer_f32(cluster_sums2 + t * cluster + cluster_rank, peer, total)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

        if lane == 0:
            weight = ptx.words_to_f32x8(gamma_words)
            for t in cutlass.range_constexpr(tokens):
                token = cutlass.min(first + t, last)
                sum_square = reduce.cluster_total(cluster_sums2 + t * cluster, 0, 1, cluster)
                inv_rms = inverse_rms(sum_square, hidden, config.norm_eps)
                result = ptx.words_to_f32x8(kept[t, 0, None].load()) * inv_rms * weight
                ptx.store_u32x4(
                    args.layer_input.toint() + (Int64(token) * hidden + column) * 2, ptx.f32x8_to_words(result)
                )
        clusters = (args.m + tokens - 1) // tokens
        leader = (cluster_rank == 0) & (tidx == 0) & polled & (poisoned == Boolean(False))
        protocol.advance_stage_after_all(args.stage_state, args.arrivals, stage, clusters, leader)
