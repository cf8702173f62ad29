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

An FP8 layer input (``mhc_glm5.fp8_store``) is stored token by token once every token's group
maxima are known; with 128-column groups (two warps each) that takes one more CTA barrier, after
which each token's fragment is recomputed from the same registers (the same bits) rather than kept
across it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from mhc_core.constants import NAN_BF16_PAIR, VEC_BF16, WARP_SIZE
from mhc_core.device import protocol, ptx

from . import stages
from .boundary import (
    BoundaryArgs,
    BoundaryConfig,
    BoundaryKernel,
)
from .config import CUDA_CORE_FRAGMENTS_PER_WARP, HC, MIX_INPUTS, VALUES, grouped_shared_bytes
from .fp8_store import Fp8Outputs, Fp8Store


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
        config = self.config
        return grouped_shared_bytes(config.hidden, config.cluster_size, config.tokens, config.layer_input_format)

    @cute.jit
    def body(self, args: BoundaryArgs, fp8: Fp8Outputs | None = None):
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
        sums = stages.ClusterSums.allocate(smem, tidx, cluster_rank, tokens, warps, cluster, token_major=True)
        store = None
        if cutlass.const_expr(fp8 is not None):
            store = Fp8Store.create(
                config, fp8, smem, args.layer_input, threads, tokens, CUDA_CORE_FRAGMENTS_PER_WARP, HC
            )

        stage, poisoned = stages.begin(args.prefetch, from_x, args.stage_state)
        # The post-mix's inputs are requested before fn (``mhc_glm5.boundary``).
        kept = cute.make_rmem_tensor(cute.make_layout((tokens, waves, 4), stride=(waves * 4, 4, 1)), Uint32)
        if from_x:
            for t in cutlass.range_constexpr(tokens):
                kept[t, 0, None].store(protocol.load_x(args.x, cutlass.min(first + t, last), column, hidden))
        sources = cute.make_rmem_tensor(cute.make_layout((tokens, 4), stride=(4, 1)), Uint32)
        for t in cutlass.range_constexpr(tokens):
            element = stages.stream_element(cutlass.min(first + t, last), lane, column, hidden)
            sources[t, None].store(stages.load_fragment(args.residual, element))
        fn_rows = stages.load_fn_rows(args.fn, lane, column, hidden)
        gamma_words = stages.load_fragment(args.gamma, column)
        for t in cutlass.range_constexpr(tokens):
            ptx.store_shared_u32x4(staged + ((t * HC + lane) * groups + local) * 4, sources[t, None].load())
        stages.stage_mix_inputs(tidx, args.post, args.comb, mix_inputs, first, last, tokens, threads, False)
        cute.arch.barrier()

        # Polled before the PDL wait; the wait comes before the first output store (``boundary``).
        polled = Boolean(True)
        if from_x:
            polled = Boolean(False)
            if poisoned:
                kept.fill(Uint32(NAN_BF16_PAIR))
        else:
            mailbox_base = args.mailbox.iterator.toint()
            counter = stages.counts_tokens(group, cluster_rank, tidx, args.spin_limit_ns)
            poisoned = protocol.poll_slots(
                kept,
                protocol.MailboxView(mailbox_base, stage, tp, args.capacity, hidden),
                protocol.Slots(first, last, fragment, tokens),
                protocol.RankLane(lane, HC, True),
                protocol.SpinBound(args.spin_limit_ns, args.error_flag, args.stage_state.iterator.toint()),
                poisoned,
                protocol.TokenCountCheck(tp > 1, counter, args.m),
            )
            # Lanes leave the poll at different times; the shuffles below need the warp converged.
            cute.arch.sync_warp()
            reduced = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
            for t in cutlass.range_constexpr(tokens):
                reduced.store(protocol.lane_sum(kept, t, waves))
                protocol.sum_over_lanes(reduced, HC)
                # The all-reduced sublayer output is BF16, as the collective returns it.
                kept[t, 0, None].store(ptx.f32x8_to_words(reduced.load()))
            protocol.rearm_slots(
                protocol.MailboxView(mailbox_base, stage, tp, args.capacity, hidden),
                protocol.Slots(first, last, fragment, tokens),
                protocol.RankLane(lane, HC, poisoned == Boolean(False)),
            )
        cute.arch.griddepcontrol_launch_dependents()

        # Per token: the post-mix (kept: stream ``lane`` from here), the GEMV, and the warp's sums
        # of the 25 values by one reduce-scatter (lane ``i`` stores value ``i``).
        for t in cutlass.range_constexpr(tokens):
            inputs = mix_inputs + t * MIX_INPUTS
            stream_words = stages.post_mix_staged(
                ptx.words_to_f32x8(kept[t, 0, None].load()),
                inputs,
                lane,
                lambda i: ptx.words_to_f32x8(ptx.load_shared_u32x4(staged + ((t * HC + i) * groups + local) * 4)),  # noqa: B023
            )
            kept[t, 0, None].store(stream_words)
            partial = stages.gemv_partials(lambda row: fn_rows[row, None].load(), stream_words, config.mixed_fma)
            sums.values_over_warp(t, warp, partial)
        sums.values_to_cluster()

        cute.arch.griddepcontrol_wait()
        for t in cutlass.range_constexpr(tokens):
            element = stages.stream_element(cutlass.min(first + t, last), lane, column, hidden)
            stages.store_fragment(args.residual_out, element, kept[t, 0, None].load())
        hc_eps = Float32(config.hc_eps)
        for t in cutlass.range_constexpr(tokens):
            rstd = stages.mixes_rstd(sums.totals + t * VALUES, hidden, config.rms_eps)
            if (cluster_rank == 0) & (tidx == Int32(t)) & (first + t <= last):
                stages.write_raw_mixes(sums.totals + t * VALUES, rstd, args.mixes_out, first + t)
            pre = stages.pre_mix(sums.totals + t * VALUES, rstd, lane, args.scale, args.base, hc_eps)
            prenorm_words = stages.collapse_streams(kept[t, 0, None].load(), pre)
            kept[t, 0, None].store(prenorm_words)
            sums.square_over_warp(t, warp, prenorm_words, lane, config.mixed_fma)
        sums.squares_to_cluster()

        if cutlass.const_expr(store is None):
            if lane == 0:
                weight = ptx.words_to_f32x8(gamma_words)
                for t in cutlass.range_constexpr(tokens):
                    token = cutlass.min(first + t, last)
                    sum_square = sums.square_total(t)
                    inv_rms = stages.inverse_rms(sum_square, hidden, config.norm_eps)
                    result = ptx.words_to_f32x8(kept[t, 0, None].load()) * inv_rms * weight
                    stages.store_row(args.layer_input, token, column, hidden, result)
        else:
            self.store_quantized(store, args, kept, gamma_words, sums, first, last, fragment, lane, warp, tidx,
                                 cluster_rank)  # fmt: skip
        stages.finish(
            tidx, args.stage_state, args.arrivals, stage, stages.group_count(args.m, tokens), cluster_rank, polled,
            poisoned,
        )  # fmt: skip

    @cute.jit
    def store_quantized(
        self, store: Fp8Store, args: BoundaryArgs, kept: cute.Tensor, gamma_words: cute.TensorSSA,
        sums: stages.ClusterSums, first: Int32, last: Int32, fragment: Int32, lane: Int32, warp: Int32,
        tidx: Int32, cluster_rank: Int32,
    ):  # fmt: skip
        """Every token's layer input as FP8 (``mhc_glm5.fp8_store``): the fragment computed in every
        lane of its 4, its group's absmax, then lane 0's codes and the scale. A repeated token (a short
        last group) writes the same values again. Then this thread's share of the scale padding rows."""
        config = self.config
        tokens = config.tokens
        for t in cutlass.range_constexpr(tokens):
            inv_rms = stages.inverse_rms(sums.square_total(t), config.hidden, config.norm_eps)
            words = store.fragment_words(kept[t, 0, None].load(), inv_rms, gamma_words)
            absmax = store.warp_max(words)
            if cutlass.const_expr(store.crosses_warps):
                store.share(Int32(t), warp, absmax, cute.arch.lane_idx() == 0)
            else:
                token = cutlass.min(first + t, last)
                store.store_bf16(token, fragment, words, lane == 0)
                store.store(token, fragment, args.m, words, absmax, lane == 0)
        if cutlass.const_expr(store.crosses_warps):
            store.exchange()
            for t in cutlass.range_constexpr(tokens):
                # The same operations on the same registers: the same bits as before the barrier.
                inv_rms = stages.inverse_rms(sums.square_total(t), config.hidden, config.norm_eps)
                words = store.fragment_words(kept[t, 0, None].load(), inv_rms, gamma_words)
                token = cutlass.min(first + t, last)
                store.store_bf16(token, fragment, words, lane == 0)
                store.store(token, fragment, args.m, words, store.group_max(Int32(t), warp, Uint32(0)), lane == 0)
        store.store_padding(args.m, cluster_rank, tidx, config.threads, config.cluster_size)
