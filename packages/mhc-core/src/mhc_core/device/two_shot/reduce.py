"""The two-shot all-reduce's middle kernel: reduce this rank's slice, gather it to every rank.

Two-shot (reduce-scatter, then all-gather) moves ``2 (tp - 1) / tp`` of a row per rank where the
one-shot moves ``tp - 1`` rows, at the price of one more Lamport round trip. Per call:

1. the scatter publish (``PublishConfig.scatter``) stores slice ``j`` (``hidden / tp`` columns) of
   this rank's partial into rank ``j``'s reduce-scatter mailbox ``[3, tp, capacity, hidden / tp]``;
2. this kernel (rank ``j``) polls its tp slices, sums them in FP32 in the one-shot's fixed tree
   (``lanes``, ``mhc_core.reference.tp_sum``), rounds to BF16 and stores the reduced slice at
   columns ``[j hidden / tp, (j + 1) hidden / tp)`` of slot ``[stage, 0, token]`` of every rank's
   gather mailbox ``[3, 1, capacity, hidden]``;
3. the model's boundary kernel, compiled for tp = 1, polls the gather mailbox as its one rank and
   runs the whole epilogue (post-mix, pre-mix, RMSNorm, GEMV, FP8) on the reduced row.

Every rank's boundary therefore reads the same BF16 row: ranks are bit-identical, and each equals the
tp = 1 op fed with ``bf16(tp_sum(partials))``. The one-shot feeds the FP32 sum to the epilogue
without that rounding, so the two protocols may differ by the rounding of the reduced row.

Stages: the three kernels share the op's one stage state. The scatter publish reads NEXT and records
ACTIVE as a one-shot publish does; this kernel reads ACTIVE and moves nothing; the boundary reads the
same stage (ACTIVE, or NEXT before its PDL wait) and moves NEXT on. Both mailboxes use that stage as
their generation, so the op's error word poisons all three kernels, and the one-shot's, alike.
PDL: this kernel releases its dependent only after its own wait, so the boundary's early loads of its
inputs (``prefetch``) come after everything the scatter publish waited for.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64

from ...constants import STAGE_STATE_WORDS, VEC_BF16
from .. import protocol, ptx
from ..configs import ReduceConfig
from ..kernel import DeviceKernel
from ..signature import Buffer, Param, Scalar, Signature, Stream


class ReduceKernel(DeviceKernel):
    """Poll and sum this rank's slice of every rank's row; store it into every rank's gather mailbox."""

    name = "reduce"
    config_type = ReduceConfig

    def signature(self) -> Signature:
        return (
            Param("mailbox", Buffer(BFloat16, divisibility=VEC_BF16)),  # this rank's reduce-scatter mailbox
            Param("stage_state", Buffer(Int32, extent=STAGE_STATE_WORDS, align=4)),
            Param("capacity", Scalar(Int32)),
            Param("spin_limit_ns", Scalar(Int64)),
            Param("error_flag", Scalar(Int64)),
            Param("destinations", Buffer(Int64, extent=self.config.tp, align=8)),  # every rank's gather mailbox
            Param("rank", Scalar(Int32)),
            Param("m", Scalar(Int32)),
            Param("stream", Stream()),
        )

    @cute.jit
    def __call__(self, mailbox, stage_state, capacity, spin_limit_ns, error_flag, destinations, rank, m, stream):
        self.kernel(mailbox, stage_state, capacity, spin_limit_ns, error_flag, destinations, rank).launch(
            grid=(m, self.config.ctas_per_token, 1),
            block=(self.config.threads, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        mailbox: cute.Tensor,
        stage_state: cute.Tensor,
        capacity: Int32,
        spin_limit_ns: Int64,
        error_flag: Int64,
        destinations: cute.Tensor,
        rank: Int32,
    ):
        config = self.config
        lanes, tp = config.lanes, config.tp
        tidx, _, _ = cute.arch.thread_idx()
        token, chunk, _ = cute.arch.block_idx()
        lane = tidx % lanes
        fragment = chunk * config.groups_per_cta + tidx // lanes  # within this rank's slice
        active = fragment < config.slice_fragments
        base = mailbox.iterator.toint()

        cute.arch.griddepcontrol_wait()
        stage, poisoned = protocol.active_stage(stage_state)
        leader = (token == 0) & (chunk == 0) & (tidx == 0)
        m, _, _ = cute.arch.grid_dim()
        total = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        poisoned = protocol.poll_and_sum(
            total,
            protocol.MailboxView(base, stage, tp, capacity, config.slice_hidden),
            protocol.Slots(token, token, fragment),
            protocol.RankLane(lane, lanes, active),
            protocol.SpinBound(spin_limit_ns, error_flag, stage_state.iterator.toint()),
            poisoned,
            protocol.TokenCountCheck(True, leader & (spin_limit_ns > Int64(0)), m),
        )
        healthy = poisoned == Boolean(False)
        if active & (lane == 0) & healthy:  # a poisoned kernel stores nothing, as a poisoned publish
            words = ptx.sanitize_negative_zero(ptx.f32x8_to_words(total.load()))
            column = rank * config.slice_fragments + fragment
            offset = protocol.slot_bytes(stage, Int32(0), token, column, 1, capacity, config.hidden)
            # The table is read here, not held across the poll (live through it, it spilled on sm_100a).
            bases = protocol.load_destinations(destinations, tp)
            for peer in cutlass.range_constexpr(tp):
                ptx.store_u32x4(bases[peer] + offset, words)
        cute.arch.griddepcontrol_launch_dependents()
        protocol.rearm_slots(
            protocol.MailboxView(base, stage, tp, capacity, config.slice_hidden),
            protocol.Slots(token, token, fragment),
            protocol.RankLane(lane, lanes, active & healthy),
        )
