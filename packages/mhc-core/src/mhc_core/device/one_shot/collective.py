"""The plain Lamport collective: poll every rank's fragment, FP32 sum, BF16 out.

Grid ``(M, ceil(fragments / (threads / lanes)))``; ``lanes`` threads per fragment
share the ranks (see ``mhc_core.device.protocol``). The output is the BF16 rounding of
the FP32 sum, bit-identical on every rank and to ``mhc_core.reference.tp_sum``; NaN once
the op is poisoned (``mhc_core.device.protocol``).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64

from ...constants import STAGE_STATE_WORDS, VEC_BF16
from .. import protocol, ptx
from ..configs import CollectiveConfig
from ..kernel import DeviceKernel
from ..signature import Buffer, Param, Ptr, Scalar, Signature, Stream


def mailbox_params() -> Signature:
    """The persistent protocol arguments every collective takes, in this order."""
    return (
        Param("mailbox", Buffer(BFloat16, divisibility=VEC_BF16)),
        Param("stage_state", Buffer(Int32, extent=STAGE_STATE_WORDS, align=4)),
        Param("capacity", Scalar(Int32)),
        Param("spin_limit_ns", Scalar(Int64)),
        Param("error_flag", Scalar(Int64)),
    )


class CollectiveKernel(DeviceKernel):
    name = "collective"
    config_type = CollectiveConfig

    def signature(self) -> Signature:
        return (Param("out", Ptr(BFloat16)), *mailbox_params(), Param("m", Scalar(Int32)), Param("stream", Stream()))

    @cute.jit
    def __call__(self, out, mailbox, stage_state, capacity, spin_limit_ns, error_flag, m, stream):
        self.kernel(out, mailbox, stage_state, capacity, spin_limit_ns, error_flag).launch(
            grid=(m, self.config.ctas_per_token, 1),
            block=(self.config.threads, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        out: cute.Pointer,
        mailbox: cute.Tensor,
        stage_state: cute.Tensor,
        capacity: Int32,
        spin_limit_ns: Int64,
        error_flag: Int64,
    ):
        config = self.config
        lanes, tp, hidden = config.lanes, config.tp, config.hidden
        tidx, _, _ = cute.arch.thread_idx()
        token, chunk, _ = cute.arch.block_idx()
        lane = tidx % lanes
        fragment = chunk * config.groups_per_cta + tidx // lanes
        active = fragment < config.fragments
        base = mailbox.iterator.toint()

        cute.arch.griddepcontrol_wait()
        stage, poisoned = protocol.active_stage(stage_state)
        leader = (token == 0) & (chunk == 0) & (tidx == 0)
        m, _, _ = cute.arch.grid_dim()
        total = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        poisoned = protocol.poll_and_sum(
            total,
            protocol.MailboxView(base, stage, tp, capacity, hidden),
            protocol.Slots(token, token, fragment),
            protocol.RankLane(lane, lanes, active),
            protocol.SpinBound(spin_limit_ns, error_flag, stage_state.iterator.toint()),
            poisoned,
            protocol.TokenCountCheck(tp > 1, leader & (spin_limit_ns > Int64(0)), m),
        )
        if active & (lane == 0):
            element = Int64(token) * hidden + Int64(fragment) * VEC_BF16
            ptx.store_u32x4(out.toint() + element * 2, ptx.f32x8_to_words(total.load()))
        healthy = poisoned == Boolean(False)
        protocol.advance_stage(stage_state, stage, leader & healthy)
        cute.arch.griddepcontrol_launch_dependents()
        protocol.rearm_slots(
            protocol.MailboxView(base, stage, tp, capacity, hidden),
            protocol.Slots(token, token, fragment),
            protocol.RankLane(lane, lanes, active & healthy),
        )
