"""The DSV4.1 collective: Lamport all-reduce fused with the mHC post-mix, the carried-pre
collapse and RMSNorm (the reference's ``_LamportMHCDeviceKernel``).

Two variants of one kernel (``MHCConfig.persistent``), the op picking by M
(``PERSISTENT_MIN_TOKENS``): the one-token collective, one cluster of ``cluster_size`` CTAs per token
(grid ``(M, cluster_size)``), and the persistent one, grid ``(min(M, clusters), cluster_size)``,
whose cluster ``c`` takes tokens ``c, c + clusters, ...``. Per fragment, with ``x`` the all-reduced
sublayer output rounded to BF16:

* ``mixed_j = x * post[j] + sum_i residual[i] * comb[i, j]`` (sources in order),
  stored as ``residual_out[:, j]`` in BF16;
* ``collapse = bf16(sum_j bf16(mixed_j) * pre[j])`` (streams in order, from 0);
* ``layer_input = bf16(collapse * rsqrt(sum(collapse^2) / hidden + eps) * weight)``,
  the sum of squares reduced over the cluster through distributed shared memory.

With an FP8 ``MHCConfig.layer_input_format`` the layer input is quantised in registers at that
store (``store_quantized_layer_input``, ``mhc_core.device.quant``): E4M3 codes and one scale per
group of 128 or 32 columns, in the format's layout, in place of the BF16 layer input or beside it
(``layer_input_bf16``), bit for bit ``mhc_core.fp8.quantize`` of the BF16 values.

A cluster's first token's residual streams, weight and mixes are loaded into registers, before the
PDL wait when the op says the kernel right before is a publish (``prefetch``). The persistent
collective copies its later tokens' streams and mixes (and at tp = 1 their ``x``) into shared
memory with ``cp.async``, ``staged_tokens - 1`` tokens ahead, so a token's loads overlap the
reduction and stores of the one before (the one-token collective has nothing of the next token in
flight while it reduces and stores: at M = 1024 that held it at 1.65 times its byte floor,
BENCHMARKS.md, tenth and eleventh runs). The slots are re-armed after reading and the next stage is
set once per launch.

At tp = 1 a launch with ``direct`` set reads ``x`` itself after the PDL wait (the op's plain
calls: one launch, no publish, no mailbox traffic), with -0 read as +0 as a publish would
have written it, so its outputs are bitwise the mailbox path's; nothing is polled, re-armed
or moved on. The MoE finalize and the two-phase form keep the mailbox path. Once the op is poisoned
(``mhc_core.device.protocol``: an earlier kernel failed) the sums are NaN, so every output is
(FP8: every code NaN, 0x7F, every scale NaN: FP32 NaN or UE8M0 0xFF; scale padding stays 0), and
nothing is re-armed or moved on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32

from mhc_core.constants import VEC_BF16
from mhc_core.device import bundle, protocol, ptx, quant, reduce
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.one_shot.collective import mailbox_params
from mhc_core.device.signature import Param, Ptr, Scalar, Signature, Stream

from .config import MHCConfig

#: The scale tensor's element type per layout (``mhc_core.fp8.Fp8Format.scale_dtype``).
SCALE_DTYPES = {quant.ROW_MAJOR: Float32, quant.MN_MAJOR_PACKED: Int32, quant.SWIZZLED_128X4: Uint8}
#: Scales are stored 4 bytes at a time at most (an FP32 scale, a padding word).
SCALE_ALIGN = 4


# Argument bundles of the kernel's device functions: trace-time groups (a field read emits
# nothing, so the PTX is what the separate arguments gave), frozen so that the DSL passes them
# into a dynamic region read-only (``mhc_core.device.protocol``'s bundles). One whose values a
# loop carries (``TokenTurn``, ``TokenInputs``) is built in the call, inside that loop.
@dataclass(frozen=True)
class ThreadPlace:
    """Where this thread sits for the whole launch: its index, its CTA's rank in the cluster, its
    rank lane (``leader``: lane 0, which holds the fragment), its group and first fragment."""

    tidx: Int32
    cluster_rank: Int32
    lane: Int32
    leader: Boolean
    group: Int32
    base_fragment: Int32


@dataclass(frozen=True)
class TokenTurn:
    """The token a cluster finishes: its ``iteration`` of the cluster's loop (0 in the one-token
    collective), its staging ``buffer``, and the launch's ``clusters`` (the loop's stride) and ``m``."""

    token: Int32
    iteration: Int32
    buffer: Int32
    clusters: Int32
    m: Int32


@dataclass(frozen=True)
class TokenInputs:
    """A token's inputs in registers: its residual streams ``[trips, hc, 4]`` words, its mixes (post
    and pre ``[hc]``, comb ``[hc, hc]`` FP32) and the norm weight ``[trips, 4]`` words."""

    stream_words: cute.Tensor
    post_mix: cute.Tensor
    pre_mix: cute.Tensor
    comb_mix: cute.Tensor
    gamma_words: cute.Tensor


@dataclass(frozen=True)
class DirectX:
    """tp = 1's direct read of the sublayer output: ``x``, whether this launch reads it
    (``protocol.reads_x``) and, persistent, its staging buffers in shared memory (else None)."""

    x: cute.Pointer
    from_x: Boolean
    staged: cute.Pointer | None


@dataclass(frozen=True)
class ClusterScratch:
    """Shared FP32 words of the sum of squares' reduction: one per warp, two per peer CTA."""

    warp_sums: cute.Pointer
    cluster_sums: cute.Pointer


@dataclass(frozen=True)
class TokenOutputs:
    """What a token writes: the residual streams, the layer input (BF16; FP8 configs write the codes
    and scales, None in a BF16 one, and the BF16 one only with ``layer_input_bf16``)."""

    residual_out: cute.Pointer
    layer_input: cute.Pointer
    layer_input_q: cute.Pointer | None
    layer_input_scales: cute.Pointer | None


@dataclass(frozen=True)
class StagingBuffers:
    """The persistent collective's shared staging of later tokens: ``staged_tokens`` buffers each of
    residual fragments, of ``x`` fragments (a direct read) and of mixes."""

    streams: cute.Pointer
    x: cute.Pointer
    mixes: cute.Pointer


@dataclass(frozen=True)
class TokenSources:
    """Where a token's inputs are read from in global memory (``x``: a direct read only)."""

    residual: cute.Pointer
    post: cute.Pointer
    comb: cute.Pointer
    pre: cute.Pointer
    x: cute.Pointer


# The entry's parameters in bundles (``mhc_core.device.bundle``): ``call_quantized`` builds them,
# ``_launch`` and the device entry take them; the fields are ``signature()``'s, in its order.
@dataclass(frozen=True)
class MixInputs(bundle.KernelBundle):
    """What the collective mixes with the sublayer output: the residual streams, the post, comb
    and pre mixes, the norm weight."""

    residual: cute.Pointer
    post: cute.Pointer
    comb: cute.Pointer
    pre: cute.Pointer
    gamma: cute.Pointer


@dataclass(frozen=True)
class LayerOutputs(bundle.KernelBundle):
    """The BF16 outputs: the residual streams and the layer input."""

    residual_out: cute.Pointer
    layer_input: cute.Pointer


@dataclass(frozen=True)
class SublayerOutput(bundle.KernelBundle):
    """Whether the kernel right before is the publish (``prefetch``), and tp = 1's direct read of
    the sublayer output ``x`` (``direct``)."""

    prefetch: Int32
    x: cute.Pointer
    direct: Int32


@dataclass(frozen=True)
class Exchange(bundle.KernelBundle):
    """The mailbox and the stage state (``mhc_core.device.one_shot.collective.mailbox_params``)."""

    mailbox: cute.Tensor
    stage_state: cute.Tensor
    capacity: Int32
    spin_limit_ns: Int64
    error_flag: Int64


class LamportMHCKernel(DeviceKernel):
    name = "collective"
    config_type = MHCConfig

    def signature(self) -> Signature:
        """The BF16 layer input's parameters; an FP8 format appends ``layer_input_q`` (E4M3
        ``[M, hidden]``) and ``layer_input_scales`` (its layout's tensor), and ``layer_input`` is then
        written only with ``layer_input_bf16`` (any 16-byte aligned address otherwise)."""
        params: Signature = (
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
            Param("clusters", Scalar(Int32)),
            Param("m", Scalar(Int32)),
            Param("stream", Stream()),
        )
        if self.config.quantizes:
            params += (
                Param("layer_input_q", Ptr(Float8E4M3FN)),
                Param("layer_input_scales", Ptr(SCALE_DTYPES[self.config.scale_layout], SCALE_ALIGN)),
            )
        return params

    def entry(self) -> Any:
        """The ``@cute.jit`` function to compile: its parameters are exactly ``signature()``'s. A BF16
        config's has no FP8 outputs at all (TVM-FFI counts a defaulted ``None`` parameter as one
        every caller must pass: a BF16 kernel with them expected 21 arguments where the host
        passes 19)."""
        return self.call_quantized if self.config.quantizes else self.__call__

    @cute.jit
    def __call__(
        self, residual, post, comb, pre, gamma, residual_out, layer_input, eps, prefetch, x, direct,
        mailbox, stage_state, capacity, spin_limit_ns, error_flag, clusters, m, stream,
    ):  # fmt: skip
        self.call_quantized(
            residual, post, comb, pre, gamma, residual_out, layer_input, eps, prefetch, x, direct,
            mailbox, stage_state, capacity, spin_limit_ns, error_flag, clusters, m, stream, None, None,
        )  # fmt: skip

    @cute.jit
    def call_quantized(
        self, residual, post, comb, pre, gamma, residual_out, layer_input, eps, prefetch, x, direct,
        mailbox, stage_state, capacity, spin_limit_ns, error_flag, clusters, m, stream,
        layer_input_q, layer_input_scales,
    ):  # fmt: skip
        """The FP8 entry (``__call__``, the BF16 one, passes None for the two FP8 outputs)."""
        self._launch(
            MixInputs(residual, post, comb, pre, gamma),
            LayerOutputs(residual_out, layer_input),
            eps,
            SublayerOutput(prefetch, x, direct),
            Exchange(mailbox, stage_state, capacity, spin_limit_ns, error_flag),
            clusters,
            m,
            stream,
            layer_input_q,
            layer_input_scales,
        )

    def _launch(
        self,
        inputs: MixInputs,
        outputs: LayerOutputs,
        eps: Float32,
        sublayer: SublayerOutput,
        exchange: Exchange,
        clusters: Int32,
        m: Int32,
        stream: Any,
        layer_input_q: cute.Pointer | None,
        layer_input_scales: cute.Pointer | None,
    ):
        """Traced inside either entry (a plain method: the DSL inlines it)."""
        config = self.config
        self.kernel(inputs, outputs, eps, sublayer, exchange, m, layer_input_q, layer_input_scales).launch(
            grid=(cutlass.min(m, clusters) if config.persistent else m, config.cluster_size, 1),
            block=(config.threads, 1, 1),
            cluster=(1, config.cluster_size, 1),
            smem=config.shared_bytes,
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        inputs: MixInputs,
        outputs: LayerOutputs,
        eps: Float32,
        sublayer: SublayerOutput,
        exchange: Exchange,
        m: Int32,
        layer_input_q: cute.Pointer,
        layer_input_scales: cute.Pointer,
    ):
        # The bundles unpacked into the names the body reads (a field read emits nothing).
        residual, post, comb, pre, gamma = bundle.values(inputs)
        residual_out, layer_input = bundle.values(outputs)
        prefetch, x, direct = bundle.values(sublayer)
        mailbox, stage_state, capacity, spin_limit_ns, error_flag = bundle.values(exchange)
        config = self.config
        hc, tp, lanes, hidden, trips = config.hc, config.tp, config.rank_lanes, config.hidden, config.trips
        groups, mixes, depth = config.groups_per_cta, config.staged_mixes, config.staged_tokens
        tidx, _, _ = cute.arch.thread_idx()
        first_token, _, _ = cute.arch.block_idx()
        clusters, _, _ = cute.arch.grid_dim()
        cluster_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        lane = tidx % lanes
        leader = lane == 0
        group = tidx // lanes
        base_fragment = cluster_rank * config.groups_per_cta + group
        mailbox_base = mailbox.iterator.toint()
        from_x = protocol.reads_x(direct, tp)

        smem = cutlass.memory.SmemAllocator()
        stream_stage = x_stage = mix_stage = None
        if cutlass.const_expr(config.persistent):
            # ``depth`` buffers each: [trips, hc, groups] and [trips, groups] fragments, [mixes] FP32.
            stream_stage = smem.allocate_array(Uint32, depth * config.staged_stream_words, byte_alignment=16)
            x_stage = smem.allocate_array(Uint32, depth * config.staged_x_words, byte_alignment=16)
            mix_stage = smem.allocate_array(Float32, depth * mixes, byte_alignment=16)
        warp_sums = smem.allocate_array(Float32, config.warps)
        cluster_sums = smem.allocate_array(Float32, 2 * config.cluster_size)

        # A direct read comes with prefetch off (the kernel before is x's producer, not a publish).
        if prefetch == Int32(0):
            cute.arch.griddepcontrol_wait()
        # Weight, residual streams and mixes: written before the publish's producer ran. The first
        # token's go straight into registers (all of a launch of up to ``clusters`` tokens).
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
                    element = (Int64(first_token) * hc + source) * hidden + column
                    stream_words[trip, source, None].store(ptx.load_u32x4(residual.toint() + element * 2))
        post_mix = cute.make_rmem_tensor(cute.make_layout((hc,)), Float32)
        pre_mix = cute.make_rmem_tensor(cute.make_layout((hc,)), Float32)
        comb_mix = cute.make_rmem_tensor(cute.make_layout((hc, hc), stride=(hc, 1)), Float32)
        for target in cutlass.range_constexpr(hc):
            mix = Int64(first_token) * hc + target
            post_mix[target] = cute.arch.load((post + mix).llvm_ptr, Float32)
            pre_mix[target] = cute.arch.load((pre + mix).llvm_ptr, Float32)
            for source in cutlass.range_constexpr(hc):
                comb_mix[source, target] = cute.arch.load(
                    (comb + (Int64(first_token) * hc + source) * hc + target).llvm_ptr, Float32
                )
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(config.quantizes):
            self.zero_scale_padding(layer_input_scales, m, first_token, clusters, cluster_rank, tidx)
        place = ThreadPlace(tidx, cluster_rank, lane, leader, group, base_fragment)
        staging = StagingBuffers(stream_stage, x_stage, mix_stage)
        sources = TokenSources(residual, post, comb, pre, x)
        # The next tokens of a looping cluster: one cp.async group each, in token order (the
        # ``depth - 1`` after the first here, then one per later iteration), token ``i`` of this
        # cluster in buffer ``i % depth``; ``depth - 1`` groups may still be in flight when one is used.
        for ahead in cutlass.range_constexpr(1, depth if config.persistent else 1):
            self.stage_token(ahead, staging, sources, from_x, first_token + ahead * clusters, m, place)

        stage, poisoned = protocol.active_stage(stage_state)
        state = stage_state.iterator.toint()
        mailbox_view = protocol.MailboxView(mailbox_base, stage, tp, capacity, hidden)
        spin = protocol.SpinBound(spin_limit_ns, error_flag, state)
        direct_x = DirectX(x, from_x, x_stage)
        scratch = ClusterScratch(warp_sums, cluster_sums)
        outputs = TokenOutputs(residual_out, layer_input, layer_input_q, layer_input_scales)
        if cutlass.const_expr(not config.persistent):
            self.finish_token(
                TokenTurn(first_token, Int32(0), Int32(0), clusters, m),
                TokenInputs(stream_words, post_mix, pre_mix, comb_mix, gamma_words),
                place, direct_x, scratch, outputs, eps, mailbox_view, stage_state, spin, poisoned,
            )  # fmt: skip
            return
        iteration = Int32(0)
        for token in range(first_token, m, clusters):
            buffer = iteration % depth
            if iteration > Int32(0):
                self.stage_token(
                    (iteration + depth - 1) % depth, staging, sources, from_x, token + (depth - 1) * clusters, m, place
                )
                cute.arch.cp_async_wait_group(depth - 1)  # this token's copies have landed (this thread's)
                cute.arch.barrier()  # and every thread's (the mixes)
                streams = stream_stage + buffer * config.staged_stream_words
                for trip in cutlass.range_constexpr(trips):
                    for source in cutlass.range_constexpr(hc):
                        slot = streams + ((trip * hc + source) * groups + group) * 4
                        stream_words[trip, source, None].store(ptx.load_shared_u32x4(slot))
                staged_mixes = mix_stage + buffer * mixes
                for target in cutlass.range_constexpr(hc):
                    post_mix[target] = cute.arch.load((staged_mixes + target).llvm_ptr, Float32)
                    pre_mix[target] = cute.arch.load((staged_mixes + hc + target).llvm_ptr, Float32)
                    for source in cutlass.range_constexpr(hc):
                        comb_mix[source, target] = cute.arch.load(
                            (staged_mixes + 2 * hc + source * hc + target).llvm_ptr, Float32
                        )
            poisoned = self.finish_token(
                TokenTurn(token, iteration, buffer, clusters, m),
                TokenInputs(stream_words, post_mix, pre_mix, comb_mix, gamma_words),
                place, direct_x, scratch, outputs, eps, mailbox_view, stage_state, spin, poisoned,
            )  # fmt: skip
            iteration = iteration + 1

    @cute.jit
    def finish_token(
        self,
        turn: TokenTurn,
        inputs: TokenInputs,
        place: ThreadPlace,
        direct: DirectX,
        scratch: ClusterScratch,
        outputs: TokenOutputs,
        eps: Float32,
        mailbox: protocol.MailboxView,
        stage_state: cute.Tensor,
        spin: protocol.SpinBound,
        poisoned: Boolean,
    ) -> Boolean:
        """One token from its inputs in registers (streams, mixes; x read directly or staged, or
        polled): post-mix, stores, collapse, re-arm, the cluster's sum of squares, the normalized
        layer input. Returns whether the op is poisoned."""
        config = self.config
        hc, tp, lanes, hidden, trips, groups = (
            config.hc, config.tp, config.rank_lanes, config.hidden, config.trips, config.groups_per_cta
        )  # fmt: skip
        # Unpacked once into the names the body reads (a field read emits nothing).
        token, iteration, buffer, clusters, m = turn.token, turn.iteration, turn.buffer, turn.clusters, turn.m
        stream_words, post_mix = inputs.stream_words, inputs.post_mix
        pre_mix, comb_mix = inputs.pre_mix, inputs.comb_mix
        tidx, cluster_rank, lane, leader = place.tidx, place.cluster_rank, place.lane, place.leader
        group, base_fragment = place.group, place.base_fragment
        x, from_x, x_stage = direct.x, direct.from_x, direct.staged
        residual_out, layer_input = outputs.residual_out, outputs.layer_input
        stage = mailbox.stage

        first_thread = (token == 0) & (cluster_rank == 0) & (tidx == 0)
        prenorm_words = cute.make_rmem_tensor(cute.make_layout((trips, 4), stride=(4, 1)), Uint32)
        prenorm_words.fill(Uint32(0))
        total = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            active = fragment < config.fragments
            if from_x:
                total.fill(Float32(0.0))
                if active & leader:
                    column = Int64(fragment) * VEC_BF16
                    if cutlass.const_expr(config.persistent):
                        if iteration == Int32(0):
                            total.store(ptx.words_to_f32x8(protocol.load_x(x, token, column, hidden)))
                        else:
                            slot = x_stage + buffer * config.staged_x_words + (trip * groups + group) * 4
                            words = ptx.sanitize_negative_zero(ptx.load_shared_u32x4(slot))
                            total.store(ptx.words_to_f32x8(words))
                    else:
                        total.store(ptx.words_to_f32x8(protocol.load_x(x, token, column, hidden)))
                if poisoned:
                    total.fill(Float32(float("nan")))  # a direct read's poison (the poll's is its own)
            else:
                # The grid's first thread also checks every rank's M (trip 0, spin bound on;
                # ``mhc_core.device.protocol``).
                poisoned = protocol.poll_and_sum(
                    total,
                    mailbox,
                    protocol.Slots(token, token, fragment),
                    protocol.RankLane(lane, lanes, active),
                    spin,
                    poisoned,
                    protocol.TokenCountCheck(tp > 1 and trip == 0, first_thread & (spin.limit_ns > Int64(0)), m),
                )
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
        if cutlass.const_expr(config.persistent):
            if token + clusters >= m:
                cute.arch.griddepcontrol_launch_dependents()  # this cluster's last poll is done
        else:
            cute.arch.griddepcontrol_launch_dependents()
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            protocol.rearm_slots(
                mailbox,
                protocol.Slots(token, token, fragment),
                protocol.RankLane(lane, lanes, (fragment < config.fragments) & healthy),
            )

        squares = cute.make_rmem_tensor(cute.make_layout((1,)), Float32)
        squares[0] = Float32(0.0)
        for trip in cutlass.range_constexpr(trips):
            fragment = base_fragment + trip * config.fragment_stride
            if (fragment < config.fragments) & leader:
                values = ptx.words_to_f32x8(prenorm_words[trip, None].load())
                squares[0] = squares[0] + (values * values).reduce(
                    cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0
                )
        # Each token's peer sums go to its buffer's slots: a peer already on the next token
        # cannot overwrite what this CTA still reads.
        sums = scratch.cluster_sums + (iteration % 2) * config.cluster_size
        reduce.block_to_cluster(squares, 1, scratch.warp_sums, sums, cluster_rank, config.threads, config.cluster_size)
        sum_squares = reduce.cluster_total(sums, 0, 1, config.cluster_size)
        inv_rms = cute.math.rsqrt(sum_squares / Float32(hidden) + eps, fastmath=True)
        if cutlass.const_expr(config.quantizes):
            self.store_quantized_layer_input(token, m, prenorm_words, inputs.gamma_words, inv_rms, outputs, place)
        else:
            for trip in cutlass.range_constexpr(trips):
                fragment = base_fragment + trip * config.fragment_stride
                if (fragment < config.fragments) & leader:
                    prenorm = ptx.words_to_f32x8(prenorm_words[trip, None].load())
                    weight = ptx.words_to_f32x8(inputs.gamma_words[trip, None].load())
                    element = Int64(token) * hidden + Int64(fragment) * VEC_BF16
                    ptx.store_u32x4(layer_input.toint() + element * 2, ptx.f32x8_to_words(prenorm * inv_rms * weight))
        return poisoned

    @cute.jit
    def zero_scale_padding(
        self, layer_input_scales: cute.Pointer, m: Int32, cluster: Int32, clusters: Int32, cluster_rank: Int32,
        tidx: Int32,
    ) -> None:  # fmt: skip
        """This thread's share of the scale padding rows (``quant.store_padding_rows``), over every
        thread of the grid's clusters. Right after the PDL wait: the stores leave before the poll, so
        at M = 1 their latency hides behind it instead of lengthening the kernel's tail."""
        config = self.config
        cluster_threads = config.cluster_size * config.threads
        thread = cluster * Int32(cluster_threads) + cluster_rank * Int32(config.threads) + tidx
        quant.store_padding_rows(
            config.scale_layout, layer_input_scales.toint(), m, thread, clusters * Int32(cluster_threads),
            config.scale_groups,
        )  # fmt: skip

    @cute.jit
    def store_quantized_layer_input(
        self, token: Int32, m: Int32, prenorm_words: cute.Tensor, gamma_words: cute.Tensor, inv_rms: Float32,
        outputs: TokenOutputs, place: ThreadPlace,
    ) -> None:  # fmt: skip
        """The token's normalized layer input as FP8 E4M3 with one scale per group (and in BF16 too
        with ``layer_input_bf16``), rounded as ``mhc_core.fp8.quantize`` rounds the BF16 values.

        Placement (``MHCConfig._check_layer_input``): a group's ``group / 8`` fragments are
        consecutive fragments of one trip in one CTA, held by the leaders of an aligned segment of
        ``group / 8 * rank_lanes`` lanes of one warp. ``quant.segment_max`` leaves the group's absmax
        in every lane of it; each leader computes the scale, quantises its own fragment and stores
        its 8 codes; the leader of the group's first fragment stores the scale. (The scale padding
        rows are zeroed once per thread, right after the PDL wait: ``zero_scale_padding``.)
        """
        config = self.config
        hidden, layout, groups = config.hidden, config.scale_layout, config.scale_groups
        layer_input = outputs.layer_input
        layer_input_q, layer_input_scales = outputs.layer_input_q, outputs.layer_input_scales
        leader, base_fragment = place.leader, place.base_fragment
        fragments_per_group = config.fp8_group // VEC_BF16
        steps = fragments_per_group.bit_length() - 1  # log2: a group is 4 or 16 fragments
        scales = layer_input_scales.toint()
        for trip in cutlass.range_constexpr(config.trips):
            fragment = base_fragment + trip * config.fragment_stride
            # The same for a whole segment: the token's fragments hold whole groups.
            holds = (fragment < config.fragments) & leader
            element = Int64(token) * hidden + Int64(fragment) * VEC_BF16
            words = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
            words.fill(Uint32(0))
            if holds:
                prenorm = ptx.words_to_f32x8(prenorm_words[trip, None].load())
                weight = ptx.words_to_f32x8(gamma_words[trip, None].load())
                words.store(ptx.f32x8_to_words(prenorm * inv_rms * weight))
                if cutlass.const_expr(config.layer_input_bf16):
                    ptx.store_u32x4(layer_input.toint() + element * 2, words.load())
            absmax = quant.segment_max(quant.fragment_absmax_bits(words.load()), config.rank_lanes, steps)
            if holds:
                scale = quant.group_scale(absmax)
                if cutlass.const_expr(layout == quant.ROW_MAJOR):
                    low, high = quant.quantize_fragment_divide(words.load(), scale)
                    code = ptx.f32_to_bits(scale)
                else:
                    code = quant.ue8m0_exponent(scale)
                    low, high = quant.quantize_fragment_scaled(words.load(), quant.ue8m0_reciprocal(code))
                ptx.store_u32x2(layer_input_q.toint() + element * quant.E4M3_BYTES, low, high)
                if fragment % fragments_per_group == 0:
                    group_index = fragment // fragments_per_group
                    quant.store_group_scale(layout, scales, token, group_index, m, groups, code)

    @cute.jit
    def stage_token(
        self,
        buffer: Int32,
        staging: StagingBuffers,
        sources: TokenSources,
        from_x: Boolean,
        token: Int32,
        m: Int32,
        place: ThreadPlace,
    ):
        """Start copying ``token``'s inputs into staging buffer ``buffer`` and commit them as one
        group (an empty one past the last token, so that every token has its group)."""
        config = self.config
        base_fragment, group, leader = place.base_fragment, place.group, place.leader
        if token < m:
            self.stage_inputs(
                staging.streams + buffer * config.staged_stream_words, staging.mixes + buffer * config.staged_mixes,
                sources.residual, sources.post, sources.comb, sources.pre, token, base_fragment, group, leader,
            )  # fmt: skip
            if from_x:
                self.stage_x(staging.x + buffer * config.staged_x_words, sources.x, token, base_fragment, group, leader)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def stage_inputs(
        self,
        streams: cute.Pointer,
        mixes: cute.Pointer,
        residual: cute.Pointer,
        post: cute.Pointer,
        comb: cute.Pointer,
        pre: cute.Pointer,
        token: Int32,
        base_fragment: Int32,
        group: Int32,
        leader: Boolean,
    ):
        """Start copying ``token``'s residual fragments (a group leader's own) and its mixes (post,
        pre, comb: one FP32 per thread and trip, 4-byte copies as their rows are 4-byte aligned)."""
        config = self.config
        hc = config.hc
        if leader:
            for trip in cutlass.range_constexpr(config.trips):
                fragment = base_fragment + trip * config.fragment_stride
                if fragment < config.fragments:
                    for source in cutlass.range_constexpr(hc):
                        element = (Int64(token) * hc + source) * config.hidden + Int64(fragment) * VEC_BF16
                        slot = streams + ((trip * hc + source) * config.groups_per_cta + group) * 4
                        ptx.copy_async_16(slot, residual.toint() + element * 2)
        tidx, _, _ = cute.arch.thread_idx()
        for trip in cutlass.range_constexpr(-(-config.staged_mixes // config.threads)):
            index = tidx + trip * config.threads
            if index < Int32(config.staged_mixes):
                address = comb.toint() + (Int64(token) * (hc * hc) + Int64(index - 2 * hc)) * 4
                if index < Int32(2 * hc):
                    address = pre.toint() + (Int64(token) * hc + Int64(index - hc)) * 4
                if index < Int32(hc):
                    address = post.toint() + (Int64(token) * hc + Int64(index)) * 4
                ptx.copy_async_4(mixes + index, address)

    @cute.jit
    def stage_x(
        self, staged: cute.Pointer, x: cute.Pointer, token: Int32, base_fragment: Int32, group: Int32, leader: Boolean
    ):
        """Start copying ``token``'s fragments of ``x`` (a direct read; after the PDL wait)."""
        config = self.config
        if leader:
            for trip in cutlass.range_constexpr(config.trips):
                fragment = base_fragment + trip * config.fragment_stride
                if fragment < config.fragments:
                    element = Int64(token) * config.hidden + Int64(fragment) * VEC_BF16
                    ptx.copy_async_16(staged + (trip * config.groups_per_cta + group) * 4, x.toint() + element * 2)
