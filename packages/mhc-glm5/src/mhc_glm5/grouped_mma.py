"""The grouped GLM-5.3 boundary on tensor cores: 8 or 16 tokens per cluster, the GEMV as ``mma.sync``.

The CUDA-core GEMV costs 24 FMAs per element and token (plus, on sm_90, widening
every ``fn`` half); from 8 tokens per cluster it is the bottleneck. Here a warp
holds 8 tokens at once and the GEMV is ``D[token, row] = sum_k s[token, k] * fn[row, k]``
in m16n8k16 steps: A = the streams (rows: tokens ``g`` and ``g + 8``), B = ``fn``
(columns: the 24 rows in three n-tiles). The products are exact (BF16 x BF16 in
FP32) and accumulated in FP32, like the dot of the other kernels; only the order
of the sums differs (the tests bound it).

Layout: a CTA owns ``S = hidden / 8 / cluster_size`` fragments (8 columns of every
stream), a warp 4 consecutive ones (``mhc_glm5.config.mma_threads``: twice the
other kernels' threads, so a lone cluster has more warps to hide latency). Lane
``l``: token ``g = l / 4`` (and ``g + 8`` with 16 tokens), ``q = l % 4``.

1. Before the PDL wait (``prefetch``; at tp = 1 with ``direct``, right after it, with x
   read into registers and sanitised only at its use, so that nothing waits on it): bulk
   copies (``ptx.bulk_copy``, waited for on an mbarrier after the first poll) of every
   token's residual streams, one per token and source (the CTA's columns are contiguous
   there), 4-byte asynchronous copies of post / comb, then the bulk copies of the CTA's
   ``fn`` columns (``mhc_glm5.fn_stage``, waited for before the MMA): the post-mix's
   inputs are requested first. Every warp issues its share of the bulk copies: issued from
   one warp's lanes they held that warp ~1 us at 32 copies, and it every other warp at the
   next barrier (thirteenth run: 0.91 x at M = 64). Measured on the H200 (hidden 4096, tp 1): the residual's
   16-byte ``cp.async`` copies took ~1.4 us to issue at 8 tokens, and a use of x right
   after its load held the rest of the prologue until it landed; without both, a call
   took 0.3-0.5 us less at M = 32-64 and 1.4 us less at M = 128. The staging is row
   ``(token, source)``, padded like the staged ``fn`` rows (16 bytes mod 128): the
   per-lane reads of step 2 (tokens ``g``, ``g + 1`` x 4 consecutive fragments per
   quarter-warp) and the MMA operand reads of step 3 (8 rows at one fragment) each touch
   8 distinct 16-byte bank groups, so none has bank conflicts.
2. Per token half, lane ``q`` owns fragment ``q`` of the warp for token ``g``: it polls
   it from every rank, before the PDL wait (``mhc_glm5.boundary``; summed in the same
   FP32 tree as the rank lanes of the other kernels: ``protocol.rank_tree_sum``),
   post-mixes all 4 streams and writes them back over the sources in shared memory.
3. MMA: lane ``q`` feeds stream ``q`` of each of the warp's fragments; the k index is
   permuted so that its k-slots ``2q, 2q + 1, 2q + 8, 2q + 9`` are the fragment's
   columns 0-3 (then 4-7), and B is read with the same permutation (staged ``fn`` rows
   ``8 n + g`` of stream ``q``). Warps and then the cluster reduce the 24 x tokens sums
   and each token's sum of squares (warps in order, peers in rank order).
4. After the PDL wait: store ``residual_out`` from shared memory, collapse
   ``bf16((t0 + t1) + (t2 + t3))``, ``t_j = s_j * pre_j``, and RMS-normalise for the
   lane's fragment.

Tokens past M (a short last group) are inactive: nothing polled, re-armed or stored.

An FP8 layer input (``mhc_glm5.fp8_store``): lane ``(g, q)`` quantises its fragment of token ``g``; a
32-column group is the warp's 4 fragments (2 shuffles over the token's 4 lanes), a 128-column group
4 warps (their maxima exchanged through shared memory, one more CTA barrier, after which each
fragment is recomputed from the same registers rather than kept across it).

The persistent boundary (``mhc_glm5.persistent``) runs this kernel's stages (its methods below) on
groups of 8 tokens in a loop per cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from mhc_core.constants import VEC_BF16, WARP_SIZE
from mhc_core.device import protocol, ptx

from . import fn_stage, stages
from .boundary import (
    BoundaryArgs,
    BoundaryConfig,
    BoundaryKernel,
)
from .config import (
    FN_ROTATION_ROWS,
    HC,
    MIX,
    MIX_INPUTS,
    MMA_FRAGMENTS_PER_WARP,
    MMA_TOKENS,
    VALUES,
    fn_chunk_words,
    mma_shared_bytes,
    mma_threads,
)
from .fp8_store import Fp8Outputs, Fp8Store

#: Fragments per warp (``mhc_glm5.config.mma_threads``): lane ``q`` owns fragment ``q`` outside the MMA.
FRAGMENTS_PER_WARP = MMA_FRAGMENTS_PER_WARP
#: Tokens per warp-wide MMA row block (lane groups).
TOKENS_PER_HALF = WARP_SIZE // HC
#: The 24 fn rows as three n-tiles of 8 columns.
N_TILES = MIX // 8
#: Fragments each lane owns outside the MMA: ``q`` (``q + 4``, ... with more fragments per warp).
LANE_FRAGMENTS = FRAGMENTS_PER_WARP // HC


@dataclass(frozen=True)
class LanePlace:
    """Where a thread of the tensor-core kernels sits, fixed for the launch: its CTA's rank in the
    cluster, its thread index, warp and lane in the warp, the warp's first fragment in the CTA
    (``local``) and in the hidden dimension (``first_fragment``), and its lane group's token ``g``
    and its stream / rank lane ``q``. An argument bundle: a trace-time group (a field read emits
    nothing, so the PTX is what the separate arguments gave), frozen so that the DSL passes it
    into a dynamic region read-only."""

    cluster_rank: Int32
    tidx: Int32
    warp: Int32
    lane_id: Int32
    local: Int32
    first_fragment: Int32
    g: Int32
    q: Int32


@cute.jit
def staged_slot(fragment: Int32, source: Int32, token: Int32, fragments: cutlass.Constexpr[int]) -> Int32:
    """Word offset of a staged fragment: row ``(token, source)`` holds the CTA's ``fragments``
    fragments, rows ``fn_chunk_words`` apart (the 16-byte rotation of the staged ``fn`` rows)."""
    return (token * HC + source) * fn_chunk_words(fragments, FN_ROTATION_ROWS) + fragment * 4


class MmaGroupBoundaryKernel(BoundaryKernel):
    name = "boundary_mma"
    config_type = BoundaryConfig

    def __init__(self, config: BoundaryConfig) -> None:
        if config.tokens not in MMA_TOKENS:
            raise ValueError(f"tokens: expected one of {MMA_TOKENS} for the tensor-core boundary, got {config.tokens}")
        if config.groups_per_cta % FRAGMENTS_PER_WARP:
            raise ValueError(f"hidden / 8 / cluster_size = {config.groups_per_cta} must be a multiple of 4")
        super().__init__(config)

    def shared_bytes(self) -> int:
        config = self.config
        return mma_shared_bytes(config.hidden, config.cluster_size, config.tokens, config.layer_input_format)

    def block_threads(self) -> int:
        return mma_threads(self.config.hidden, self.config.cluster_size)

    @property
    def stream_words(self) -> int:
        """Words of one group's staged residual streams: a row per (token, source), padded like the
        staged ``fn`` rows (``staged_slot``)."""
        return self.config.tokens * HC * fn_chunk_words(self.config.groups_per_cta, FN_ROTATION_ROWS)

    @property
    def stream_bytes(self) -> int:
        """Bytes one group's stream copies move: what its barrier's phase expects."""
        return self.config.tokens * HC * self.config.groups_per_cta * 16

    @cute.jit
    def body(self, args: BoundaryArgs, fp8: Fp8Outputs | None = None):
        """One group of ``tokens`` tokens per cluster."""
        config = self.config
        tp, cluster, tokens = config.tp, config.cluster_size, config.tokens
        fragments, threads = config.groups_per_cta, self.block_threads()
        warps = threads // WARP_SIZE
        halves = tokens // TOKENS_PER_HALF
        tidx, _, _ = cute.arch.thread_idx()
        group, _, _ = cute.arch.block_idx()
        cluster_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane_id = cute.arch.lane_idx()
        g = lane_id // HC  # token (of each half)
        q = lane_id % HC  # stream / rank lane
        local = warp * FRAGMENTS_PER_WARP  # the warp's first fragment in the CTA
        first_fragment = cluster_rank * fragments + local
        first = group * tokens
        last = args.m - 1
        from_x = protocol.reads_x(args.direct, tp)

        smem = cutlass.memory.SmemAllocator()
        fn_staged, fn_barrier = fn_stage.allocate(smem, fragments, FN_ROTATION_ROWS)
        staged_barrier = smem.allocate_array(Int64, 1, byte_alignment=8)
        staged = smem.allocate_array(Uint32, self.stream_words, byte_alignment=16)
        mix_inputs = smem.allocate_array(Float32, tokens * MIX_INPUTS)
        sums = stages.ClusterSums.allocate(smem, tidx, cluster_rank, tokens, warps, cluster, token_major=False)
        store = self.fp8_store(fp8, smem, args)

        stage, poisoned = stages.begin(args.prefetch, from_x, args.stage_state)
        # What the post-mix needs is requested first (the streams, x when read directly, post /
        # comb), fn after it: the SM takes them in about that order. Both barriers are armed first.
        fn_stage.arm(staged_barrier, self.stream_bytes)
        fn_stage.arm(fn_barrier, fn_stage.slice_bytes(fragments))
        cute.arch.barrier()
        self.copy_streams(args, staged, staged_barrier, first, last, cluster_rank)
        # Per token half: lane q's fragments of token g (or g + 8), every rank (x: rank 0 only).
        kept = [
            cute.make_rmem_tensor(cute.make_layout((LANE_FRAGMENTS, tp, 4), stride=(tp * 4, 4, 1)), Uint32)
            for _ in range(halves)
        ]
        if from_x:
            for h in cutlass.range_constexpr(halves):
                self.load_x_words(args, kept[h], first + h * TOKENS_PER_HALF + g, last, first_fragment, q)
        gamma_words = self.start_mixes_fn_weight(
            args, mix_inputs, first, last, fn_staged, fn_barrier, tidx, cluster_rank, first_fragment, q
        )

        # Polled before the PDL wait; the wait comes before the first output store (``boundary``).
        mailbox_base = args.mailbox.iterator.toint()
        polled = Boolean(True)
        counter = stages.counts_tokens(group, cluster_rank, tidx, args.spin_limit_ns)
        squares = cute.make_rmem_tensor(cute.make_layout((halves,)), Float32)
        for h in cutlass.range_constexpr(halves):
            t = h * TOKENS_PER_HALF + g
            token = first + t
            active = token <= last
            if from_x:
                polled = Boolean(False)
            else:
                poisoned = self.poll_half(
                    args, kept[h], mailbox_base, stage, token, active, first_fragment + q, poisoned, counter,
                    tp > 1 and h == 0,
                )  # fmt: skip
            if cutlass.const_expr(h == halves - 1):
                cute.arch.griddepcontrol_launch_dependents()
            if cutlass.const_expr(h == 0):
                # post / comb landed (this thread's copies) and are visible to all (the barrier);
                # the streams' bulk copies complete the staged barrier's phase.
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                fn_stage.wait(staged_barrier)
            squares[h] = self.post_mix_half(kept[h], staged, mix_inputs + t * MIX_INPUTS, t, local, q, from_x, poisoned)
        self.gemv_to_cluster(staged, fn_staged, fn_barrier, sums, squares, warp, local, g, q)
        self.epilogue(
            args, staged, sums, gamma_words, first, last,
            LanePlace(cluster_rank, tidx, warp, lane_id, local, first_fragment, g, q), store,
        )  # fmt: skip
        if cutlass.const_expr(store is not None):
            store.store_padding(args.m, cluster_rank, tidx, threads, cluster)
        stages.finish(
            tidx, args.stage_state, args.arrivals, stage, stages.group_count(args.m, tokens), cluster_rank, polled,
            poisoned,
        )  # fmt: skip

    # ------------------------------------------------------------ stages
    def fp8_store(self, fp8: Fp8Outputs | None, smem: cutlass.memory.SmemAllocator, args: BoundaryArgs):
        """The FP8 layer input's store (None for a BF16 kernel), its shared words allocated last."""
        if fp8 is None:
            return None
        if LANE_FRAGMENTS != 1:
            raise ValueError("the FP8 store takes lane q of a token's 4 to hold the warp's fragment q")
        config = self.config
        return Fp8Store.create(
            config, fp8, smem, args.layer_input, self.block_threads(), config.tokens, FRAGMENTS_PER_WARP, 1
        )

    @cute.jit
    def copy_streams(
        self, args: BoundaryArgs, staged: cute.Pointer, barrier: cute.Pointer, first: Int32, last: Int32,
        cluster_rank: Int32,
    ):  # fmt: skip
        """The residual streams of tokens ``first ..``: one bulk copy per (token, source) row of the
        CTA's columns (a short last group copies its last token again), against ``barrier``."""
        config = self.config
        hidden, tokens, fragments = config.hidden, config.tokens, config.groups_per_cta
        cta_fragment = cluster_rank * fragments

        def stream_row(row: Int32) -> Int64:
            token = cutlass.min(first + row // HC, last)
            return (Int64(token) * HC + Int64(row % HC)) * hidden + Int64(cta_fragment) * VEC_BF16

        fn_stage.copy_rows(
            args.residual, stream_row, lambda row: staged + staged_slot(Int32(0), row % HC, row // HC, fragments),
            tokens * HC, fragments * 16, barrier, self.block_threads(), True,
        )  # fmt: skip

    @cute.jit
    def load_x_words(
        self, args: BoundaryArgs, kept: cute.Tensor, token: Int32, last: Int32, first_fragment: Int32, q: Int32
    ):
        """Lane ``q``'s fragments of x for ``token`` (a direct read), raw: sanitised at their use, as a
        use here would hold the prologue until they land. Tokens past M read the last token (like
        the staging): their results are never stored."""
        row = cutlass.min(token, last)
        for k in cutlass.range_constexpr(LANE_FRAGMENTS):
            column = Int64(first_fragment + q + k * HC) * VEC_BF16
            kept[k, 0, None].store(protocol.load_x_raw(args.x, row, column, self.config.hidden))

    @cute.jit
    def start_mixes_fn_weight(
        self, args: BoundaryArgs, mix_inputs: cute.Pointer, first: Int32, last: Int32, fn_staged: cute.Pointer,
        fn_barrier: cute.Pointer, tidx: Int32, cluster_rank: Int32, first_fragment: Int32, q: Int32,
    ) -> cute.Tensor:  # fmt: skip
        """The prologue's rest, after the streams and x: the first group's post / comb copies, the
        CTA's ``fn`` copies, the lane's norm weight (returned)."""
        config = self.config
        fragments, threads = config.groups_per_cta, self.block_threads()
        stages.stage_mix_inputs(tidx, args.post, args.comb, mix_inputs, first, last, config.tokens, threads, True)
        fn_stage.copy(
            args.fn, fn_staged, fn_barrier, cluster_rank * fragments, fragments, FN_ROTATION_ROWS, config.hidden,
            threads, True,
        )  # fmt: skip
        return self.load_gamma(args, first_fragment, q)

    @cute.jit
    def load_gamma(self, args: BoundaryArgs, first_fragment: Int32, q: Int32) -> cute.Tensor:
        """The norm weight of the lane's fragments."""
        gamma_words = cute.make_rmem_tensor(cute.make_layout((LANE_FRAGMENTS, 4), stride=(4, 1)), Uint32)
        for k in cutlass.range_constexpr(LANE_FRAGMENTS):
            column = Int64(first_fragment + q + k * HC) * VEC_BF16
            gamma_words[k, None].store(stages.load_fragment(args.gamma, column))
        return gamma_words

    @cute.jit
    def poll_half(
        self, args: BoundaryArgs, kept: cute.Tensor, mailbox_base: Int64, stage: Uint32, token: Int32,
        active: Boolean, fragment: Int32, poisoned: Boolean, counter: Boolean, counts: cutlass.Constexpr[bool],
    ) -> Boolean:  # fmt: skip
        """One thread polls every rank of its fragments of ``token`` (fragment step 4, rank lanes 1)
        and re-arms them; returns whether the op is poisoned."""
        config = self.config
        mailbox = protocol.MailboxView(mailbox_base, stage, config.tp, args.capacity, config.hidden)
        # The lane's fragments of one token: ``fragment``, ``fragment + HC``, ...
        slots = protocol.Slots(token, token, fragment, LANE_FRAGMENTS, token_step=0, fragment_step=HC)
        half_poisoned = protocol.poll_slots(
            kept,
            mailbox,
            slots,
            protocol.RankLane(Int32(0), 1, active),
            protocol.SpinBound(args.spin_limit_ns, args.error_flag, args.stage_state.iterator.toint()),
            poisoned,
            protocol.TokenCountCheck(counts, counter, args.m),
        )
        poisoned = poisoned | half_poisoned
        protocol.rearm_slots(mailbox, slots, protocol.RankLane(Int32(0), 1, active & (half_poisoned == Boolean(False))))
        return poisoned

    @cute.jit
    def post_mix_half(
        self, kept: cute.Tensor, staged: cute.Pointer, inputs: cute.Pointer, t: Int32, local: Int32, q: Int32,
        from_x: Boolean, poisoned: Boolean,
    ) -> Float32:  # fmt: skip
        """Token ``t``'s 4 streams of the lane's fragments, post-mixed and written back over the
        sources in ``staged``; returns their sum of squares over the lane's group."""
        config = self.config
        fragments = config.groups_per_cta
        square = Float32(0.0)
        for k in cutlass.range_constexpr(LANE_FRAGMENTS):
            f = local + q + k * HC
            if from_x:
                kept[k, 0, None].store(ptx.sanitize_negative_zero(kept[k, 0, None].load()))
                if poisoned:
                    kept[k, 0, None].store(ptx.nan_u32x4())
            # The all-reduced sublayer output is BF16, as the collective returns it.
            summed = protocol.rank_tree_sum(kept, k, config.tp, HC).to(cutlass.BFloat16).to(Float32)
            sources = [
                ptx.words_to_f32x8(ptx.load_shared_u32x4(staged + staged_slot(f, i, t, fragments))) for i in range(HC)
            ]
            for j in cutlass.range_constexpr(HC):
                stream_words = stages.post_mix_staged(summed, inputs, j, lambda i: sources[i])  # noqa: B023
                square = square + ptx.dot_bf16x8(stream_words, stream_words, config.mixed_fma)
                # This lane alone reads source j of this fragment and token.
                ptx.store_shared_u32x4(staged + staged_slot(f, j, t, fragments), stream_words)
        return stages.group_sum(square)

    @cute.jit
    def gemv_to_cluster(
        self, staged: cute.Pointer, fn_staged: cute.Pointer, fn_barrier: cute.Pointer, sums: stages.ClusterSums,
        squares: cute.Tensor, warp: Int32, local: Int32, g: Int32, q: Int32,
    ):  # fmt: skip
        """The GEMV on tensor cores and the warps' 24 x tokens sums and sums of squares, reduced over
        the cluster into ``sums.totals``."""
        self.gemv_partials(staged, fn_staged, fn_barrier, sums, squares, warp, local, g, q)
        sums.values_to_cluster()

    @cute.jit
    def gemv_partials(
        self, staged: cute.Pointer, fn_staged: cute.Pointer, fn_barrier: cute.Pointer, sums: stages.ClusterSums,
        squares: cute.Tensor, warp: Int32, local: Int32, g: Int32, q: Int32,
    ):  # fmt: skip
        """The GEMV on tensor cores; the warps' 24 x tokens sums and sums of squares into ``sums.warp``."""
        config = self.config
        tokens, fragments = config.tokens, config.groups_per_cta
        halves = tokens // TOKENS_PER_HALF
        # The MMA reads the streams the other lanes of the warp wrote.
        cute.arch.sync_warp()

        # GEMV: A = streams (tokens g, g + 8), B = fn rows (tile * 8 + g, stream q), one k-half per MMA.
        fn_stage.wait(fn_barrier)
        acc = cute.make_rmem_tensor(cute.make_layout((N_TILES, 4), stride=(4, 1)), Float32)
        acc.fill(Float32(0.0))
        for f in cutlass.range_constexpr(FRAGMENTS_PER_WARP):
            low = ptx.load_shared_u32x4(staged + staged_slot(local + f, q, g, fragments))
            high = low
            if cutlass.const_expr(halves == 2):
                high = ptx.load_shared_u32x4(staged + staged_slot(local + f, q, g + TOKENS_PER_HALF, fragments))
            for tile in cutlass.range_constexpr(N_TILES):
                b = fn_stage.load(fn_staged, tile * 8 + g, q, local + f, fragments, FN_ROTATION_ROWS)
                for k in cutlass.range_constexpr(2):
                    a = [ptx.element(words, 2 * k + i) for i in range(2) for words in (low, high)]
                    b_words = [ptx.element(b, 2 * k + i) for i in range(2)]
                    acc[tile, None].store(ptx.mma_bf16_16816(a, b_words, acc[tile, None].load()))

        # Warp partials: lane (g, q) holds rows tile * 8 + 2q, + 1 of tokens g (and g + 8).
        for tile in cutlass.range_constexpr(N_TILES):
            for h in cutlass.range_constexpr(halves):
                for k in cutlass.range_constexpr(2):
                    t = h * TOKENS_PER_HALF + g
                    slot = sums.warp + (warp * tokens + t) * VALUES + tile * 8 + 2 * q + k
                    cute.arch.store(slot.llvm_ptr, acc[tile, 2 * h + k])
        for h in cutlass.range_constexpr(halves):
            if q == Int32(0):
                t = h * TOKENS_PER_HALF + g
                cute.arch.store((sums.warp + (warp * tokens + t) * VALUES + MIX).llvm_ptr, squares[h])

    @cute.jit
    def store_streams(self, args: BoundaryArgs, token: Int32, last: Int32, fragment: Int32, streams: list):
        """The 4 post-mixed streams of one fragment of ``token`` into ``residual_out`` (not past M)."""
        if token <= last:
            column = Int64(fragment) * VEC_BF16
            for j in cutlass.range_constexpr(HC):
                element = stages.stream_element(token, j, column, self.config.hidden)
                stages.store_fragment(args.residual_out, element, streams[j])

    @cute.jit
    def store_held(self, args: BoundaryArgs, held: cute.Tensor, token: Int32, last: Int32, fragment: Int32):
        """``collapse``'s held streams of the lane's fragments of ``token`` into ``residual_out``."""
        for k in cutlass.range_constexpr(LANE_FRAGMENTS):
            streams = [held[k, j, None].load() for j in range(HC)]
            self.store_streams(args, token, last, fragment + k * HC, streams)

    @cute.jit
    def epilogue(
        self, args: BoundaryArgs, staged: cute.Pointer, sums: stages.ClusterSums, gamma_words: cute.Tensor,
        first: Int32, last: Int32, place: LanePlace, store: Fp8Store | None = None,
    ):  # fmt: skip
        """The raw mixes handed off, the PDL wait, then per token ``residual_out`` from ``staged``, the
        collapse, the cluster's sum of squares and the normalised layer input."""
        config = self.config
        warp, lane_id, first_fragment, g, q = place.warp, place.lane_id, place.first_fragment, place.g, place.q
        halves = config.tokens // TOKENS_PER_HALF
        self.write_raw_mixes(args, sums, first, last, warp, lane_id)
        prenorm = cute.make_rmem_tensor(
            cute.make_layout((halves, LANE_FRAGMENTS, 4), stride=(LANE_FRAGMENTS * 4, 4, 1)), Uint32
        )
        self.collapse(args, staged, sums, first, last, place, prenorm, None)
        sums.squares_to_cluster()
        self.store_layer_input(args, sums, prenorm, gamma_words, first, last, first_fragment, g, q, store, warp)

    @cute.jit
    def write_raw_mixes(
        self, args: BoundaryArgs, sums: stages.ClusterSums, first: Int32, last: Int32, warp: Int32, lane_id: Int32
    ):
        """Every token's raw mixes handed off from ``sums.totals`` (CTA 0, one warp per token)."""
        config = self.config
        tokens = config.tokens
        warps = self.block_threads() // WARP_SIZE
        for trip in cutlass.range_constexpr(-(-tokens // warps)):
            t = warp + trip * warps
            if (sums.cluster_rank == 0) & (lane_id == 0) & (t < Int32(tokens)) & (first + t <= last):
                rstd = stages.mixes_rstd(sums.totals + t * VALUES, config.hidden, config.rms_eps)
                stages.write_raw_mixes(sums.totals + t * VALUES, rstd, args.mixes_out, first + t)

    @cute.jit
    def collapse(
        self, args: BoundaryArgs, staged: cute.Pointer, sums: stages.ClusterSums, first: Int32, last: Int32,
        place: LanePlace, prenorm: cute.Tensor, held,
    ):  # fmt: skip
        """After the PDL wait: per token the streams from ``staged`` (stored into ``residual_out``, or
        kept in ``held`` for ``store_held``), collapsed with the pre weights from ``sums.totals`` into
        ``prenorm``, the warps' sums of squares into ``sums.warp_squares``."""
        config = self.config
        warp, local, g, q, first_fragment = place.warp, place.local, place.g, place.q, place.first_fragment
        hidden, tokens, fragments = config.hidden, config.tokens, config.groups_per_cta
        halves = tokens // TOKENS_PER_HALF
        cute.arch.griddepcontrol_wait()
        hc_eps = Float32(config.hc_eps)
        for h in cutlass.range_constexpr(halves):
            t = h * TOKENS_PER_HALF + g
            rstd = stages.mixes_rstd(sums.totals + t * VALUES, hidden, config.rms_eps)
            pre = [
                stages.pre_mix(sums.totals + t * VALUES, rstd, Int32(j), args.scale, args.base, hc_eps)
                for j in range(HC)
            ]
            square = Float32(0.0)
            for k in cutlass.range_constexpr(LANE_FRAGMENTS):
                f = local + q + k * HC
                streams = [ptx.load_shared_u32x4(staged + staged_slot(f, j, t, fragments)) for j in range(HC)]
                if cutlass.const_expr(held is None):
                    self.store_streams(args, first + t, last, first_fragment + q + k * HC, streams)
                else:
                    for j in cutlass.range_constexpr(HC):
                        held[k, j, None].store(streams[j])
                terms = [ptx.words_to_f32x8(streams[j]) * pre[j] for j in range(HC)]
                collapsed = ptx.f32x8_to_words((terms[0] + terms[1]) + (terms[2] + terms[3]))
                prenorm[h, k, None].store(collapsed)
                square = square + ptx.dot_bf16x8(collapsed, collapsed, config.mixed_fma)
            square = stages.group_sum(square)
            if q == Int32(0):
                cute.arch.store((sums.warp_squares + warp * tokens + t).llvm_ptr, square)

    @cute.jit
    def store_layer_input(
        self, args: BoundaryArgs, sums: stages.ClusterSums, prenorm: cute.Tensor, gamma_words: cute.Tensor,
        first: Int32, last: Int32, first_fragment: Int32, g: Int32, q: Int32, store: Fp8Store | None = None,
        warp: Int32 | None = None,
    ):  # fmt: skip
        """After the squares' cluster barrier: every token's collapsed row RMS-normalised and weighted
        into ``layer_input`` (the lane's fragments), or quantised (``store``: ``store_quantized``)."""
        config = self.config
        halves = config.tokens // TOKENS_PER_HALF
        if cutlass.const_expr(store is not None):
            self.store_quantized(store, args, sums, prenorm, gamma_words, first, last, first_fragment, g, q, warp)
            return
        for h in cutlass.range_constexpr(halves):
            t = h * TOKENS_PER_HALF + g
            token = first + t
            if token <= last:
                sum_square = sums.square_total(t)
                inv_rms = stages.inverse_rms(sum_square, config.hidden, config.norm_eps)
                for k in cutlass.range_constexpr(LANE_FRAGMENTS):
                    weight = ptx.words_to_f32x8(gamma_words[k, None].load())
                    result = ptx.words_to_f32x8(prenorm[h, k, None].load()) * inv_rms * weight
                    column = Int64(first_fragment + q + k * HC) * VEC_BF16
                    stages.store_row(args.layer_input, token, column, config.hidden, result)

    @cute.jit
    def store_quantized(
        self, store: Fp8Store, args: BoundaryArgs, sums: stages.ClusterSums, prenorm: cute.Tensor,
        gamma_words: cute.Tensor, first: Int32, last: Int32, first_fragment: Int32, g: Int32, q: Int32,
        warp: Int32,
    ):  # fmt: skip
        """Every token's layer input as FP8 (``mhc_glm5.fp8_store``): lane ``(g, q)``'s fragment ``q``
        of token ``g`` computed for every token (the shuffles and the barrier need every lane), its
        group's absmax, then the codes and the scale of the tokens up to M. The scale padding rows come
        once per thread, after the last group (``Fp8Store.store_padding``, from the kernel's body)."""
        config = self.config
        tokens = config.tokens
        halves = tokens // TOKENS_PER_HALF
        fragment = first_fragment + q
        for h in cutlass.range_constexpr(halves):
            t = h * TOKENS_PER_HALF + g
            inv_rms = stages.inverse_rms(sums.square_total(t), config.hidden, config.norm_eps)
            words = store.fragment_words(prenorm[h, 0, None].load(), inv_rms, gamma_words[0, None].load())
            absmax = store.warp_max(words)
            if cutlass.const_expr(store.crosses_warps):
                store.share(t, warp, absmax, q == Int32(0))
            else:
                active = first + t <= last
                store.store_bf16(first + t, fragment, words, active)
                store.store(first + t, fragment, args.m, words, absmax, active)
        if cutlass.const_expr(store.crosses_warps):
            store.exchange()
            for h in cutlass.range_constexpr(halves):
                t = h * TOKENS_PER_HALF + g
                # The same operations on the same registers: the same bits as before the barrier.
                inv_rms = stages.inverse_rms(sums.square_total(t), config.hidden, config.norm_eps)
                words = store.fragment_words(prenorm[h, 0, None].load(), inv_rms, gamma_words[0, None].load())
                active = first + t <= last
                store.store_bf16(first + t, fragment, words, active)
                store.store(first + t, fragment, args.m, words, store.group_max(t, warp, Uint32(0)), active)
