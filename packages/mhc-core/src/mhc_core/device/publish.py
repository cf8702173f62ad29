"""Publish kernels: this rank's partial (plain, or an MoE finalize) into every rank's mailbox.

Grid ``(M, ceil(fragments / threads))``: one thread per 16-byte fragment, so every
``hidden`` that is a multiple of 8 is covered completely (the seed's GLM publish
covered only whole 1024-element tiles). Values are rounded to BF16 and -0 is
sanitised to +0 before publishing: a -0 would read as "not yet written" and hang
every rank.

PDL: the publish waits (``griddepcontrol.wait``) before reading its input, which
the previous kernel wrote. It lets the dependent collective launch either right
after that wait (the GLM seed: the collective reads the mailbox only after its own
wait) or after its stores (the DSV seed).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, Uint16, Uint32

from ..constants import ERROR_ROUTE_INDEX, ROUTE_CODE, ROUTE_INDEX, ROUTE_TOKEN, STAGE_STATE_WORDS, VEC_BF16
from . import protocol, ptx
from .configs import TRIGGER_AFTER_STORES, TRIGGER_AFTER_WAIT, PublishConfig
from .kernel import DeviceKernel
from .signature import Buffer, Param, Ptr, Scalar, Signature, Stream


def _common_params(config: PublishConfig) -> Signature:
    return (
        Param("stage_state", Buffer(Int32, extent=STAGE_STATE_WORDS, align=4)),
        Param("destinations", Buffer(Int64, extent=config.destinations, align=8)),
        Param("rank", Scalar(Int32)),
        Param("capacity", Scalar(Int32)),
        Param("token_check", Scalar(Int32)),
        Param("m", Scalar(Int32)),
    )


class _PublishBase(DeviceKernel):
    config: PublishConfig

    @cute.jit
    def _begin(
        self, stage_state: cute.Tensor, destinations: cute.Tensor, rank: Int32, capacity: Int32, token_check: Int32
    ) -> tuple:
        """Load the destination table, wait for the producer, maybe release the dependent,
        read the stage and the error word; the first thread publishes M (``token_check``)."""
        config = self.config
        tidx, _, _ = cute.arch.thread_idx()
        token, chunk, _ = cute.arch.block_idx()
        fragment = chunk * config.threads + tidx
        bases = protocol.load_destinations(destinations, config.destinations)
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(config.trigger == TRIGGER_AFTER_WAIT):
            cute.arch.griddepcontrol_launch_dependents()
        leader = (token == 0) & (chunk == 0) & (tidx == 0)
        stage, poisoned = protocol.begin_publish(stage_state, leader)
        if cutlass.const_expr(config.tp > 1):  # noqa: SIM102 (a compile-time branch stands alone in the DSL)
            if leader & (token_check != Int32(0)) & (poisoned == Boolean(False)):
                m, _, _ = cute.arch.grid_dim()
                protocol.publish_count(m, stage, rank, bases, config.store, config.tp, capacity, config.slot_hidden)
        return token, fragment, stage, poisoned, bases

    @cute.jit
    def _finish(
        self,
        values: cute.TensorSSA,
        stage: Uint32,
        poisoned: Boolean,
        token: Int32,
        fragment: Int32,
        bases: cute.Tensor,
        rank: Int32,
        capacity: Int32,
    ) -> None:
        """Round to BF16, sanitise -0, publish (nothing once the op is poisoned); release the
        dependent if it waits for stores."""
        config = self.config
        if (fragment < config.fragments) & (poisoned == Boolean(False)):
            words = ptx.sanitize_negative_zero(ptx.f32x8_to_words(values))
            if cutlass.const_expr(config.scatter):
                protocol.scatter_fragment(
                    words, stage, rank, token, fragment, bases, config.tp, capacity, config.hidden
                )
            else:
                offset = protocol.slot_bytes(stage, rank, token, fragment, config.tp, capacity, config.hidden)
                protocol.publish_fragment(words, offset, bases, config.store, config.tp)
        if cutlass.const_expr(config.trigger == TRIGGER_AFTER_STORES):
            cute.arch.griddepcontrol_launch_dependents()

    def _grid(self, m: Int32) -> tuple:
        return (m, self.config.ctas_per_token, 1)


class PublishKernel(_PublishBase):
    """Publish a ``[M, hidden]`` BF16 partial."""

    name = "publish"
    config_type = PublishConfig

    def __init__(self, config: PublishConfig) -> None:
        if config.top_k:
            raise ValueError("PublishKernel takes top_k = 0; use FinalizePublishKernel for MoE output")
        super().__init__(config)

    def signature(self) -> Signature:
        return (Param("x", Ptr(BFloat16)), *_common_params(self.config), Param("stream", Stream()))

    @cute.jit
    def __call__(self, x, stage_state, destinations, rank, capacity, token_check, m, stream):
        self.kernel(x, stage_state, destinations, rank, capacity, token_check).launch(
            grid=self._grid(m), block=(self.config.threads, 1, 1), stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self,
        x: cute.Pointer,
        stage_state: cute.Tensor,
        destinations: cute.Tensor,
        rank: Int32,
        capacity: Int32,
        token_check: Int32,
    ):
        token, fragment, stage, poisoned, bases = self._begin(stage_state, destinations, rank, capacity, token_check)
        values = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        values.fill(Float32(0.0))
        if fragment < self.config.fragments:
            element = Int64(token) * self.config.hidden + Int64(fragment) * VEC_BF16
            values.store(ptx.words_to_f32x8(ptx.load_u32x4(x.toint() + element * 2)))
        self._finish(values.load(), stage, poisoned, token, fragment, bases, rank, capacity)


class FinalizePublishKernel(_PublishBase):
    """Publish an MoE output reduced on the fly.

    ``value[m] = shared[m] + sum_k weight[m, k] * gemm2[index[m, k]]`` over the
    routes with ``index >= 0``, accumulated in FP32 in that order (shared output
    first, then k ascending; each step may be one FMA), then rounded to BF16.
    All ``top_k`` rows are loaded before the first is accumulated (one batch of
    independent loads per thread).

    Index contract: every index is -1 or a row of ``gemm2`` (``< rows``). It cannot
    be checked on the host without a sync, so any index outside ``[0, rows)`` is
    skipped like -1 (one compare beside a 16-byte gather). With ``check_routes`` set
    (the ops' debug mode) an index outside ``[-1, rows)`` is also reported through
    the error flag (token, route).
    """

    name = "finalize"
    config_type = PublishConfig

    def __init__(self, config: PublishConfig) -> None:
        if config.top_k <= 0:
            raise ValueError(f"top_k: expected > 0 for a finalize publish, got {config.top_k}")
        super().__init__(config)

    def signature(self) -> Signature:
        fp32 = self.config.weights == "float32"
        return (
            Param("gemm2", Ptr(BFloat16)),
            Param("weights", Ptr(Float32, 4) if fp32 else Ptr(BFloat16, 2)),
            Param("index", Ptr(Int32, 4)),
            Param("shared", Ptr(BFloat16)),
            Param("rows", Scalar(Int32)),
            Param("check_routes", Scalar(Int32)),
            Param("error_flag", Scalar(Int64)),
            *_common_params(self.config),
            Param("stream", Stream()),
        )

    @cute.jit
    def _load_weight(self, weights: cute.Pointer, route: Int64) -> Float32:
        if cutlass.const_expr(self.config.weights == "float32"):
            return cute.arch.load((weights + route).llvm_ptr, Float32)
        return ptx.bf16_bits_to_f32(Uint32(cute.arch.load((weights + route).llvm_ptr, Uint16)))

    @cute.jit
    def __call__(
        self, gemm2, weights, index, shared, rows, check_routes, error_flag, stage_state, destinations, rank,
        capacity, token_check, m, stream,
    ):  # fmt: skip
        self.kernel(
            gemm2, weights, index, shared, rows, check_routes, error_flag, stage_state, destinations, rank,
            capacity, token_check,
        ).launch(grid=self._grid(m), block=(self.config.threads, 1, 1), stream=stream, use_pdl=True)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        gemm2: cute.Pointer,
        weights: cute.Pointer,
        index: cute.Pointer,
        shared: cute.Pointer,
        rows: Int32,
        check_routes: Int32,
        error_flag: Int64,
        stage_state: cute.Tensor,
        destinations: cute.Tensor,
        rank: Int32,
        capacity: Int32,
        token_check: Int32,
    ):
        config = self.config
        top_k = config.top_k
        token, fragment, stage, poisoned, bases = self._begin(stage_state, destinations, rank, capacity, token_check)
        values = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        values.fill(Float32(0.0))
        if fragment < config.fragments:
            column = Int64(fragment) * VEC_BF16
            values.store(
                ptx.words_to_f32x8(ptx.load_u32x4(shared.toint() + (Int64(token) * config.hidden + column) * 2))
            )
            route_rows = cute.make_rmem_tensor(cute.make_layout((top_k,)), Int32)
            route_weights = cute.make_rmem_tensor(cute.make_layout((top_k,)), Float32)
            taken = cute.make_rmem_tensor(cute.make_layout((top_k,)), Boolean)
            gathered = cute.make_rmem_tensor(cute.make_layout((top_k, 4), stride=(4, 1)), Uint32)
            gathered.fill(Uint32(0))
            for k in cutlass.range_constexpr(top_k):
                route = Int64(token) * top_k + k
                row = cute.arch.load((index + route).llvm_ptr, Int32)
                route_rows[k] = row
                route_weights[k] = self._load_weight(weights, route)
                # An index outside [0, rows) is always a dropped route (a sentinel other than -1,
                # or a bug upstream): never a gather past gemm2.
                taken[k] = (row >= Int32(0)) & (row < rows)
                if (check_routes != Int32(0)) & ((row < Int32(-1)) | (row >= rows)):
                    # The route report's own words: never over a timeout's report (issue #32).
                    ptx.store_system_u32(error_flag + Int64(ROUTE_TOKEN * 4), Uint32(token))
                    ptx.store_system_u32(error_flag + Int64(ROUTE_INDEX * 4), Uint32(k))
                    ptx.store_system_u32(error_flag + Int64(ROUTE_CODE * 4), Uint32(ERROR_ROUTE_INDEX))
            for k in cutlass.range_constexpr(top_k):
                if taken[k]:
                    element = Int64(route_rows[k]) * config.hidden + column
                    gathered[k, None].store(ptx.load_u32x4(gemm2.toint() + element * 2))
            for k in cutlass.range_constexpr(top_k):
                if taken[k]:
                    values.store(values.load() + ptx.words_to_f32x8(gathered[k, None].load()) * route_weights[k])
        self._finish(values.load(), stage, poisoned, token, fragment, bases, rank, capacity)
