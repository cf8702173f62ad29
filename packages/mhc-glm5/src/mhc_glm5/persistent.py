"""The persistent GLM-5.3 boundary for large M: the tensor-core kernel's stages
(``mhc_glm5.grouped_mma``) on groups of 8 tokens, in a loop per cluster.

The grid holds as many clusters as the device runs at once (``mhc_glm5.config.persistent_clusters``,
or the op's ``clusters``); cluster ``c`` takes groups ``c, c + clusters, ...``. ``fn`` and the norm
weight are loaded once per cluster. The loop is software pipelined over groups: while group ``k`` is
post-mixed and multiplied, group ``k - 1`` is collapsed, and one cluster barrier per group carries
``k``'s 25 values and ``k - 1``'s sums of squares (the peers' slots in two halves,
``mhc_glm5.stages.ClusterSums.half``, so that a peer a barrier ahead never writes what this CTA still
reads). Group ``k + 1``'s residual streams land by bulk copies in a third buffer
(``PERSISTENT_BUFFERS``: the group post-mixed, the one collapsed, the one copied) and its mix inputs in
a second one (``PERSISTENT_MIX_BUFFERS``); its x (tp 1, direct) is read into registers one group
ahead. Per token the arithmetic is the 8-token kernel's, bit for bit.

Why: per group of 8 tokens a CTA runs a chain of phases of about a microsecond each (post-mix,
GEMV and reduction, collapse and stores: BENCHMARKS.md, twelfth run); the 16-token kernel pays it
per wave with ``fn`` reloaded, this loop once per group with ``fn`` resident, two groups' chains
overlapped. Measured on the H200 at tp 1 (twelfth run): 2.8 % faster than the 16-token kernel at
M = 256, 0.9 % at 512, 0.3 % at 1024, slower below 256. Since both issue their copies from every
warp (thirteenth run, one run) it led at 256 and 512 and x16 at 1024.

The PDL trigger comes in the cluster's last group, after its poll; the PDL wait before the first
collapse's output stores; the cluster arrives once (``stages.finish`` over the grid's clusters).

An FP8 layer input is the tensor-core kernel's (``MmaGroupBoundaryKernel.store_quantized``), per group
of 8 tokens; its shared words, written after each group's cluster barrier, are written again only
after the next front's CTA barrier.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from mhc_core.constants import WARP_SIZE
from mhc_core.device import protocol

from . import fn_stage, stages
from .boundary import BoundaryArgs, BoundaryConfig
from .config import (
    FN_ROTATION_ROWS,
    HC,
    MIX_INPUTS,
    PERSISTENT_BUFFERS,
    PERSISTENT_MIX_BUFFERS,
    PERSISTENT_TOKENS,
    persistent_shared_bytes,
)
from .fp8_store import Fp8Outputs
from .grouped_mma import FRAGMENTS_PER_WARP, LANE_FRAGMENTS, LanePlace, MmaGroupBoundaryKernel


# Argument bundles of ``front`` (``LanePlace`` too): trace-time groups, frozen so that the DSL
# passes them into a dynamic region read-only; a field read emits nothing, so the PTX is what the
# separate arguments gave. ``GroupTurn`` and ``FrontRegisters`` are built in each call.
@dataclass(frozen=True)
class GroupTurn:
    """The group a front works on: the cluster's ``iteration`` (its ``iteration``-th group), the
    group's index, the grid's ``clusters`` (the loop's stride), the ``groups`` of the launch and the
    ``last`` token."""

    iteration: Int32
    group: Int32
    clusters: Int32
    groups: Int32
    last: Int32


@dataclass(frozen=True)
class PersistentStaging:
    """The CTA's shared staging: the stream buffers and their barriers (``PERSISTENT_BUFFERS``), the
    mix-input buffers (``PERSISTENT_MIX_BUFFERS``), and the staged ``fn`` slice with its barrier."""

    stream_buffers: cute.Pointer
    stream_barriers: cute.Pointer
    mix_buffers: cute.Pointer
    fn_staged: cute.Pointer
    fn_barrier: cute.Pointer


@dataclass(frozen=True)
class FrontRegisters:
    """A front's registers: ``kept``, the lane's polled (or read) words of the group; ``ahead``, the
    next group's x (a direct read); ``squares``, the post-mixed streams' sum of squares."""

    kept: cute.Tensor
    ahead: cute.Tensor
    squares: cute.Tensor


class PersistentBoundaryKernel(MmaGroupBoundaryKernel):
    name = "boundary_persistent"
    config_type = BoundaryConfig

    def __init__(self, config: BoundaryConfig) -> None:
        if not config.persistent or config.tokens != PERSISTENT_TOKENS:
            raise ValueError(
                f"tokens: the persistent boundary loops over groups of {PERSISTENT_TOKENS} (persistent set), "
                f"got tokens = {config.tokens}, persistent = {config.persistent}"
            )
        super().__init__(config)

    def shared_bytes(self) -> int:
        return persistent_shared_bytes(self.config.hidden, self.config.cluster_size, self.config.layer_input_format)

    @cute.jit
    def body(self, args: BoundaryArgs, fp8: Fp8Outputs | None = None):
        """Cluster ``c`` of ``clusters`` (the grid) takes groups ``c, c + clusters, ...`` of
        ``PERSISTENT_TOKENS`` tokens (one half). ``fn`` and the weight are loaded once. Software
        pipelined over groups, one cluster barrier per group: while group ``k`` is post-mixed and
        multiplied, group ``k - 1`` is collapsed, and one barrier carries group ``k``'s 25 values and
        group ``k - 1``'s sums of squares (the peers' slots alternate halves, ``ClusterSums.half``).
        Group ``k + 1``'s streams land in a third buffer (``PERSISTENT_BUFFERS``) and its mix inputs
        in a second one meanwhile; its x (a direct read) is read into registers one group ahead."""
        config = self.config
        tp, cluster, tokens = config.tp, config.cluster_size, config.tokens
        fragments, threads = config.groups_per_cta, self.block_threads()
        warps = threads // WARP_SIZE
        tidx, _, _ = cute.arch.thread_idx()
        first_group, _, _ = cute.arch.block_idx()
        clusters, _, _ = cute.arch.grid_dim()
        cluster_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane_id = cute.arch.lane_idx()
        g = lane_id // HC
        q = lane_id % HC
        local = warp * FRAGMENTS_PER_WARP
        first_fragment = cluster_rank * fragments + local
        last = args.m - 1
        groups = stages.group_count(args.m, tokens)
        from_x = protocol.reads_x(args.direct, tp)

        smem = cutlass.memory.SmemAllocator()
        fn_staged, fn_barrier = fn_stage.allocate(smem, fragments, FN_ROTATION_ROWS)
        staged_barriers = smem.allocate_array(Int64, PERSISTENT_BUFFERS, byte_alignment=8)
        staged_buffers = smem.allocate_array(Uint32, PERSISTENT_BUFFERS * self.stream_words, byte_alignment=16)
        mix_buffers = smem.allocate_array(Float32, PERSISTENT_MIX_BUFFERS * tokens * MIX_INPUTS)
        sums = stages.ClusterSums.allocate(
            smem, tidx, cluster_rank, tokens, warps, cluster, token_major=False, halves=2
        )
        store = self.fp8_store(fp8, smem, args)

        stage, poisoned = stages.begin(args.prefetch, from_x, args.stage_state)
        # Every stream buffer's first phase armed here: the first group's, and those the first two
        # fronts copy into (a phase no copy fills is never waited on). Each later phase is armed
        # before the CTA barrier that precedes its copies (the loop's, after the collapse).
        for buffer in cutlass.range_constexpr(PERSISTENT_BUFFERS):
            fn_stage.arm(staged_barriers + buffer, self.stream_bytes)
        fn_stage.arm(fn_barrier, fn_stage.slice_bytes(fragments))
        cute.arch.barrier()
        # The first group's inputs, then fn (as the tensor-core kernel orders them).
        first = first_group * tokens
        self.copy_streams(args, staged_buffers, staged_barriers, first, last, cluster_rank)
        ahead = cute.make_rmem_tensor(cute.make_layout((LANE_FRAGMENTS, tp, 4), stride=(tp * 4, 4, 1)), Uint32)
        if from_x:
            self.load_x_words(args, ahead, first + g, last, first_fragment, q)
        gamma_words = self.start_mixes_fn_weight(
            args, mix_buffers, first, last, fn_staged, fn_barrier, tidx, cluster_rank, first_fragment, q
        )

        mailbox_base = args.mailbox.iterator.toint()
        polled = Boolean(True)
        if from_x:
            polled = Boolean(False)
        kept = cute.make_rmem_tensor(cute.make_layout((LANE_FRAGMENTS, tp, 4), stride=(tp * 4, 4, 1)), Uint32)
        squares = cute.make_rmem_tensor(cute.make_layout((1,)), Float32)
        # The group before's collapsed words and post-mixed streams (stored after the barrier's arrive).
        prenorm = cute.make_rmem_tensor(
            cute.make_layout((1, LANE_FRAGMENTS, 4), stride=(LANE_FRAGMENTS * 4, 4, 1)), Uint32
        )
        held = cute.make_rmem_tensor(cute.make_layout((LANE_FRAGMENTS, HC, 4), stride=(HC * 4, 4, 1)), Uint32)

        staging = PersistentStaging(staged_buffers, staged_barriers, mix_buffers, fn_staged, fn_barrier)
        place = LanePlace(cluster_rank, tidx, warp, lane_id, local, first_fragment, g, q)
        # Group 0 of this cluster: its values alone.
        poisoned = self.front(
            args, GroupTurn(Int32(0), first_group, clusters, groups, last), staging, sums.half(Int32(0), Int32(1)),
            FrontRegisters(kept, ahead, squares), mailbox_base, stage, poisoned, from_x, place,
        )  # fmt: skip
        cute.arch.barrier()
        sums.send_values()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        sums.cluster_totals()
        self.write_raw_mixes(args, sums, first, last, warp, lane_id)
        previous = first
        iteration = Int32(1)
        for group in range(first_group + clusters, groups, clusters):
            halves = sums.half(iteration % 2, (iteration + 1) % 2)
            poisoned = self.front(
                args, GroupTurn(iteration, group, clusters, groups, last), staging, halves,
                FrontRegisters(kept, ahead, squares), mailbox_base, stage, poisoned, from_x, place,
            )  # fmt: skip
            # The group before: collapsed from its buffer, which the next front's bulk copies overwrite
            # (its next phase armed now: every thread waited on the last one in that group's front).
            freed = (iteration + PERSISTENT_BUFFERS - 1) % PERSISTENT_BUFFERS
            before = self.buffer(staged_buffers, freed)
            self.collapse(args, before, halves, previous, last, place, prenorm, held)
            fn_stage.expect(staged_barriers + freed, self.stream_bytes)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier()
            halves.send_values()
            halves.send_squares()
            cute.arch.cluster_arrive()
            self.store_held(args, held, previous + g, last, first_fragment + q)
            cute.arch.cluster_wait()
            halves.cluster_totals()
            self.write_raw_mixes(args, halves, group * tokens, last, warp, lane_id)
            self.store_layer_input(
                args, halves, prenorm, gamma_words, previous, last, first_fragment, g, q, store, warp
            )
            previous = group * tokens
            iteration = iteration + 1
        # The last group: its squares alone.
        final = sums.half(iteration % 2, (iteration + 1) % 2)
        before = self.buffer(staged_buffers, iteration + PERSISTENT_BUFFERS - 1)
        self.collapse(args, before, final, previous, last, place, prenorm, held)
        cute.arch.barrier()
        final.send_squares()
        cute.arch.cluster_arrive()
        self.store_held(args, held, previous + g, last, first_fragment + q)
        cute.arch.cluster_wait()
        self.store_layer_input(args, final, prenorm, gamma_words, previous, last, first_fragment, g, q, store, warp)
        if cutlass.const_expr(store is not None):
            store.store_padding(args.m, cluster_rank, tidx, threads, cluster)
        stages.finish(tidx, args.stage_state, args.arrivals, stage, clusters, cluster_rank, polled, poisoned)

    def buffer(self, staged_buffers: cute.Pointer, index: Int32) -> cute.Pointer:
        """Stream buffer ``index % PERSISTENT_BUFFERS``: group ``k`` of a cluster uses buffer ``k``."""
        return staged_buffers + (index % PERSISTENT_BUFFERS) * self.stream_words

    @cute.jit
    def front(
        self, args: BoundaryArgs, turn: GroupTurn, staging: PersistentStaging, sums: stages.ClusterSums,
        registers: FrontRegisters, mailbox_base: Int64, stage: Uint32, poisoned: Boolean, from_x: Boolean,
        place: LanePlace,
    ) -> Boolean:  # fmt: skip
        """The persistent loop's work on group ``turn.iteration`` of this cluster up to its warps' sums:
        the next group's copies started, x (one group ahead) or the poll, this group's inputs waited
        for, the post-mix and the GEMV. Returns whether the op is poisoned."""
        config = self.config
        # Unpacked once into the names the body reads (a field read emits nothing).
        iteration, group, clusters, groups, last = turn.iteration, turn.group, turn.clusters, turn.groups, turn.last
        staged_buffers, staged_barriers = staging.stream_buffers, staging.stream_barriers
        mix_buffers, fn_staged, fn_barrier = staging.mix_buffers, staging.fn_staged, staging.fn_barrier
        kept, ahead, squares = registers.kept, registers.ahead, registers.squares
        first_fragment, cluster_rank, tidx = place.first_fragment, place.cluster_rank, place.tidx
        warp, local, g, q = place.warp, place.local, place.g, place.q
        tokens = config.tokens
        buffer = iteration % PERSISTENT_BUFFERS
        staged = self.buffer(staged_buffers, iteration)
        first = group * tokens
        # The next group's streams into the buffer the group before last used (collapsed by now), its
        # mix inputs into the other mix buffer. Its mix inputs are always a cp.async group (an empty
        # one past the last group), so that one group stays in flight below.
        following = group + clusters
        other = (iteration + 1) % PERSISTENT_BUFFERS
        if following < groups:
            # Its buffer's phase was armed before the CTA barrier that preceded this front.
            self.copy_streams(
                args, self.buffer(staged_buffers, other), staged_barriers + other, following * tokens, last,
                cluster_rank,
            )  # fmt: skip
            stages.stage_mix_inputs(
                tidx, args.post, args.comb,
                mix_buffers + ((iteration + 1) % PERSISTENT_MIX_BUFFERS) * (tokens * MIX_INPUTS),
                following * tokens, last, tokens, self.block_threads(), True,
            )  # fmt: skip
        else:
            cute.arch.cp_async_commit_group()
        if from_x:
            kept.store(ahead.load())
            self.load_x_words(args, ahead, following * tokens + g, last, first_fragment, q)
        else:
            counter = stages.counts_tokens(group, cluster_rank, tidx, args.spin_limit_ns)
            poisoned = self.poll_half(
                args, kept, mailbox_base, stage, first + g, first + g <= last, first_fragment + q, poisoned, counter,
                config.tp > 1,
            )  # fmt: skip
        if following >= groups:
            cute.arch.griddepcontrol_launch_dependents()  # this cluster's last poll is done
        # This group's mix inputs landed (the next group's may be in flight) and are visible to all;
        # its streams' bulk copies complete its buffer's barrier phase.
        cute.arch.cp_async_wait_group(1)
        cute.arch.barrier()
        fn_stage.wait(staged_barriers + buffer, (iteration // PERSISTENT_BUFFERS) % 2)
        mix_inputs = mix_buffers + (iteration % PERSISTENT_MIX_BUFFERS) * (tokens * MIX_INPUTS)
        squares[0] = self.post_mix_half(kept, staged, mix_inputs + g * MIX_INPUTS, g, local, q, from_x, poisoned)
        self.gemv_partials(staged, fn_staged, fn_barrier, sums, squares, warp, local, g, q)
        return poisoned
