"""The GLM-5.3 boundary: Lamport all-reduce fused with the whole mHC sublayer boundary
(the reference's ``_BoundaryDeviceKernel``), one token per cluster, any TP.

One cluster of ``cluster_size`` CTAs per token; a CTA holds ``hidden / 8 /
cluster_size`` groups of 4 lanes, one group per 16-byte fragment. Lane ``j``:

1. polls ranks ``j, j + 4, ...`` (a lane with no rank adds zero) and the 4 lanes sum
   them by an xor butterfly: ``x``, the all-reduced output rounded to BF16;
2. owns stream ``j``: ``s_j = bf16(x * post[j] + sum_i residual[i] * comb[i, j])``,
   stored as ``residual_out`` once the PDL wait (step 3) has returned;
3. adds its share of the 24-row GEMV ``fn[r, j * hidden + c] * s_j[c]`` and of
   ``sum s_j^2``; the 25 sums are reduced over the cluster through DSMEM; CTA 0
   hands the raw mixes ``gemv * rsqrt(sum / (4 hidden) + rms_eps)`` off to the
   side-stream mixes kernel (``mhc_core.device.handoff``); then the PDL wait;
4. collapses ``bf16((t0 + t1) + (t2 + t3))`` with ``t_j = s_j * pre_j``,
   ``pre_j = sigmoid(raw[j] * scale[0] + base[j]) + hc_eps``, and RMS-normalises it
   after a second, one-value cluster reduction; the last cluster to finish moves the stage on.

The poll runs before the PDL wait: a Lamport slot needs no ordering, and the stage comes
from NEXT, which only this grid's last arriving cluster changes, at its end
(``mhc_core.device.protocol.stage_before_wait`` / ``advance_stage_after_all``). So the poll ends
when the data lands, not when the publish grid has completed (about 1 us later on the
H200). The wait stays before the first output store, as an output may alias what the
publish reads.

At tp = 1 a launch with ``direct`` set reads ``x`` (the sublayer output) instead of polling: no
publish ran, so nothing is polled, re-armed or moved on (the op's plain calls; the grouped
kernels do the same).

Once the op is poisoned (``mhc_core.device.protocol``: an earlier kernel failed; a direct read checks
the error word itself) the reduced x is NaN, so every output is, the raw mixes handed off too
(the mixes kernel is never left waiting), and nothing is re-armed or moved on; the stage read
before the poll tells (``mhc_core.device.protocol.read_state``).

The CTA's ``fn`` slice is staged in shared memory by bulk copies (``mhc_glm5.fn_stage``),
and the residual streams, the weight, post and comb are loaded, before the PDL wait
when the kernel right before is the publish (``prefetch``).

The boundary kernels (this one, ``mhc_glm5.grouped``, ``mhc_glm5.grouped_mma`` and
``mhc_glm5.persistent``) share one device entry, ``BoundaryKernel.kernel`` (one parameter list:
``boundary_signature``), and their stages (``mhc_glm5.stages``); each class's ``body`` wires the
stages for its thread mapping.

With an FP8 ``BoundaryConfig.layer_input_format`` (issue #33) each kernel quantises its layer input
in registers at the norm's store (``mhc_glm5.fp8_store``, where the group placement is explained):
E4M3 codes and one scale per group, in place of the BF16 layer input or beside it
(``layer_input_bf16``), bit for bit ``mhc_core.fp8.quantize`` of the BF16 values; the signature
appends ``layer_input_q`` and ``layer_input_scales``. A poisoned op writes NaN codes (0x7F) and NaN
scales (FP32 NaN, UE8M0 0xFF); scale padding stays 0. A BF16 config's repr, signature and PTX are
what they were before the option existed.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32

from mhc_core.constants import VEC_BF16, WARP_SIZE
from mhc_core.device import bundle, protocol, ptx, quant, reduce
from mhc_core.device.kernel import DeviceKernel
from mhc_core.device.one_shot.collective import mailbox_params
from mhc_core.device.signature import Buffer, Param, Ptr, Scalar, Signature, Stream
from mhc_core.fp8_formats import BF16, LayerInputConfig

from . import fn_stage, stages
from .config import (
    CUDA_CORE_FRAGMENTS_PER_WARP,
    FN_ROTATION_STREAMS,
    HC,
    VALUES,
    boundary_launch_shared_bytes,
    boundary_threads,
    check_layer_input,
)
from .fp8_store import Fp8Outputs, Fp8Store

#: The scale tensor's element type per layout (``mhc_core.fp8.Fp8Format.scale_dtype``).
SCALE_DTYPES = {quant.ROW_MAJOR: Float32, quant.MN_MAJOR_PACKED: Int32, quant.SWIZZLED_128X4: Uint8}
#: Scales are stored 4 bytes at a time at most (an FP32 scale, a padding word).
SCALE_ALIGN = 4


@dataclass(frozen=True, slots=True, repr=False)
class BoundaryConfig(LayerInputConfig):
    """Compile-time constants of the boundary kernels (rules: ``mhc_glm5.config.GLM5Preset``)."""

    hidden: int
    tp: int
    cluster_size: int
    rms_eps: float
    hc_eps: float
    norm_eps: float
    #: ``fma.rn.f32.bf16`` for the GEMV (sm_100+); else the exact FP32 fallback.
    mixed_fma: bool
    #: Tokens per cluster: 1 for ``BoundaryKernel``, more for ``GroupBoundaryKernel``.
    tokens: int = 1
    #: The persistent tensor-core boundary: ``clusters`` clusters, each looping over groups of
    #: ``tokens`` (``mhc_glm5.persistent``).
    persistent: bool = False
    #: The layer input's format (``mhc_core.fp8_formats``; ``LayerInputConfig`` derives the rest and
    #: the repr): BF16, or FP8 E4M3 quantised at the norm's store (``mhc_glm5.fp8_store``); with
    #: ``layer_input_bf16`` the BF16 layer input is stored beside it.
    layer_input_format: str = BF16
    layer_input_bf16: bool = False

    def __post_init__(self) -> None:
        check_layer_input(self.hidden, self.cluster_size, self.layer_input_format, self.layer_input_bf16)

    @property
    def fragments(self) -> int:
        return self.hidden // VEC_BF16

    @property
    def groups_per_cta(self) -> int:
        return self.fragments // self.cluster_size

    @property
    def threads(self) -> int:
        return boundary_threads(self.hidden, self.cluster_size)

    @property
    def warps(self) -> int:
        return self.threads // WARP_SIZE


def boundary_signature(config: BoundaryConfig | None = None) -> Signature:
    """Every boundary kernel's parameters; an FP8 ``config`` appends ``layer_input_q`` (E4M3
    ``[M, hidden]``) and ``layer_input_scales`` (its layout's allocation), and ``layer_input`` is
    then written only with ``layer_input_bf16`` (any 16-byte aligned address otherwise)."""
    params: Signature = (
        Param("residual", Ptr(BFloat16)),
        Param("post", Ptr(Float32, 4)),
        Param("comb", Ptr(Float32, 4)),
        Param("fn", Ptr(BFloat16)),
        Param("scale", Ptr(Float32, 4)),
        Param("base", Ptr(Float32, 4)),
        Param("gamma", Ptr(BFloat16)),
        Param("residual_out", Ptr(BFloat16)),
        Param("mixes_out", Ptr(Float32, 16)),
        Param("layer_input", Ptr(BFloat16)),
        Param("x", Ptr(BFloat16)),
        Param("prefetch", Scalar(Int32)),
        Param("direct", Scalar(Int32)),
        *mailbox_params(),
        Param("arrivals", Buffer(Int32, extent=1, align=4)),
        # The most clusters the persistent boundary launches (the other kernels launch one per group).
        Param("clusters", Scalar(Int32)),
        Param("m", Scalar(Int32)),
        Param("stream", Stream()),
    )
    # A config made without its fields (``BoundaryConfig.__new__``: the recorder kernels of
    # tests.core.test_launch_wiring_cpu, which need only the parameter names) is a BF16 one.
    if config is not None and getattr(config, "layer_input_format", BF16) != BF16:
        params += (
            Param("layer_input_q", Ptr(Float8E4M3FN)),
            Param("layer_input_scales", Ptr(SCALE_DTYPES[config.scale_layout], SCALE_ALIGN)),
        )
    return params


# The entry's parameters in bundles (``mhc_core.device.bundle``): ``call_quantized`` builds them,
# ``_launch`` and the device entry take them; the fields are ``boundary_signature``'s, in its order.
@dataclass(frozen=True)
class MixInputs(bundle.KernelBundle):
    """What the boundary mixes with the sublayer output: the residual streams, the mixes (post,
    comb; ``fn``, ``scale`` and ``base`` for the next ones) and the norm weight."""

    residual: cute.Pointer
    post: cute.Pointer
    comb: cute.Pointer
    fn: cute.Pointer
    scale: cute.Pointer
    base: cute.Pointer
    gamma: cute.Pointer


@dataclass(frozen=True)
class BoundaryOutputs(bundle.KernelBundle):
    """The BF16 outputs: the residual streams, the raw mixes handed off, the layer input."""

    residual_out: cute.Pointer
    mixes_out: cute.Pointer
    layer_input: cute.Pointer


@dataclass(frozen=True)
class SublayerOutput(bundle.KernelBundle):
    """tp = 1's direct read of the sublayer output ``x`` (``direct``), and whether the kernel
    right before is the publish (``prefetch``)."""

    x: cute.Pointer
    prefetch: Int32
    direct: Int32


@dataclass(frozen=True)
class Exchange(bundle.KernelBundle):
    """The mailbox and the stage state (``mhc_core.device.one_shot.collective.mailbox_params``), and the
    clusters' arrival counter."""

    mailbox: cute.Tensor
    stage_state: cute.Tensor
    capacity: Int32
    spin_limit_ns: Int64
    error_flag: Int64
    arrivals: cute.Tensor


#: The device entry's arguments by name (``boundary_signature`` without what only the launch takes:
#: the stream, and ``clusters``, which sizes the persistent grid; its kernel reads the grid): what
#: every boundary kernel's ``body`` reads, so the kernels share one parameter list. A named tuple,
#: not a frozen dataclass: a region that calls a method on one of its members
#: (``args.stage_state.iterator.toint()``) carries it, as the kernels' separate parameters were
#: carried (``mhc_glm5.stages``), where a frozen dataclass is never carried and moved the tensors'
#: iterator reads (the PTX of 14 of the 43 sm_90a preset kernels changed). A ``body`` therefore
#: calls methods on ``args`` members in the regions where the kernel it came from called them on its
#: parameters, and passes them to stage functions elsewhere.
BoundaryArgs = namedtuple(
    "BoundaryArgs", [param.name for param in boundary_signature() if param.name not in ("stream", "clusters")]
)


class BoundaryKernel(DeviceKernel):
    """One cluster per ``config.tokens`` tokens (1 here; ``GroupBoundaryKernel`` and
    ``MmaGroupBoundaryKernel`` take more and override ``body``, ``shared_bytes`` and, the latter,
    ``block_threads``)."""

    name = "boundary"
    config_type = BoundaryConfig

    def signature(self) -> Signature:
        return boundary_signature(self.config)

    def entry(self) -> Any:
        """The ``@cute.jit`` function to compile: its parameters are exactly ``signature()``'s (TVM-FFI
        counts a defaulted ``None`` parameter as one every caller passes), so a BF16 config's has no
        FP8 outputs."""
        return self.call_quantized if self.config.quantizes else self.__call__

    @cute.jit
    def __call__(
        self, residual, post, comb, fn, scale, base, gamma, residual_out, mixes_out, layer_input, x,
        prefetch, direct, mailbox, stage_state, capacity, spin_limit_ns, error_flag, arrivals, clusters, m, stream,
    ):  # fmt: skip
        self.call_quantized(
            residual, post, comb, fn, scale, base, gamma, residual_out, mixes_out, layer_input, x, prefetch, direct,
            mailbox, stage_state, capacity, spin_limit_ns, error_flag, arrivals, clusters, m, stream, None, None,
        )  # fmt: skip

    @cute.jit
    def call_quantized(
        self, residual, post, comb, fn, scale, base, gamma, residual_out, mixes_out, layer_input, x,
        prefetch, direct, mailbox, stage_state, capacity, spin_limit_ns, error_flag, arrivals, clusters, m, stream,
        layer_input_q, layer_input_scales,
    ):  # fmt: skip
        """The FP8 entry (``__call__``, the BF16 one, passes None for the two FP8 outputs)."""
        self._launch(
            MixInputs(residual, post, comb, fn, scale, base, gamma),
            BoundaryOutputs(residual_out, mixes_out, layer_input),
            SublayerOutput(x, prefetch, direct),
            Exchange(mailbox, stage_state, capacity, spin_limit_ns, error_flag, arrivals),
            Fp8Outputs(layer_input_q, layer_input_scales),
            clusters,
            m,
            stream,
        )

    def _launch(
        self,
        inputs: MixInputs,
        outputs: BoundaryOutputs,
        sublayer: SublayerOutput,
        exchange: Exchange,
        fp8: Fp8Outputs,
        clusters: Int32,
        m: Int32,
        stream: Any,
    ):
        """Traced inside either entry (a plain method: the DSL inlines it)."""
        config = self.config
        groups = stages.group_count(m, config.tokens)
        self.kernel(inputs, outputs, sublayer, exchange, m, fp8.q, fp8.scales).launch(
            grid=(cutlass.min(groups, clusters) if config.persistent else groups, config.cluster_size, 1),
            block=(self.block_threads(), 1, 1),
            cluster=(1, config.cluster_size, 1),
            smem=self.shared_bytes(),
            stream=stream,
            use_pdl=True,
        )

    def shared_bytes(self) -> int:
        config = self.config
        return boundary_launch_shared_bytes(config.hidden, config.cluster_size, config.layer_input_format)

    def block_threads(self) -> int:
        return self.config.threads

    @cute.kernel
    def kernel(
        self,
        inputs: MixInputs,
        outputs: BoundaryOutputs,
        sublayer: SublayerOutput,
        exchange: Exchange,
        m: Int32,
        layer_input_q: cute.Pointer,
        layer_input_scales: cute.Pointer,
    ):
        """The device entry of every boundary kernel (one parameter list, so one PTX signature; an
        FP8 kernel's two more are None in a BF16 one); each class's ``body`` is its device code."""
        args = BoundaryArgs(*bundle.values(inputs), *bundle.values(outputs), *bundle.values(sublayer),
                            *bundle.values(exchange), m)  # fmt: skip
        if cutlass.const_expr(self.config.quantizes):
            self.body(args, Fp8Outputs(layer_input_q, layer_input_scales))
        else:
            self.body(args)

    @cute.jit
    def body(self, args: BoundaryArgs, fp8: Fp8Outputs | None = None):
        config = self.config
        hidden, tp, cluster, groups = config.hidden, config.tp, config.cluster_size, config.groups_per_cta
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        cluster_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        lane = tidx % HC  # source rank lane while polling, stream afterwards
        fragment = cluster_rank * config.groups_per_cta + tidx // HC
        column = Int64(fragment) * VEC_BF16

        from_x = protocol.reads_x(args.direct, tp)

        smem = cutlass.memory.SmemAllocator()
        fn_staged, fn_barrier = fn_stage.allocate(smem, groups, FN_ROTATION_STREAMS)

        stage, poisoned = stages.begin(args.prefetch, from_x, args.stage_state)
        fn_stage.arm(fn_barrier, fn_stage.slice_bytes(groups))
        # The barrier is initialised before any copy names it.
        cute.arch.barrier()
        # From as few warps as can: the others poll meanwhile.
        fn_stage.copy(
            args.fn, fn_staged, fn_barrier, cluster_rank * groups, groups, FN_ROTATION_STREAMS, hidden, config.threads,
            False,
        )  # fmt: skip
        streams = cute.make_rmem_tensor(cute.make_layout((HC, 4), stride=(4, 1)), Uint32)
        for source in cutlass.range_constexpr(HC):
            streams[source, None].store(
                stages.load_fragment(args.residual, stages.stream_element(token, source, column, hidden))
            )
        gamma_words = stages.load_fragment(args.gamma, column)
        post_j = cute.arch.load((args.post + Int64(token) * HC + Int64(lane)).llvm_ptr, Float32)
        comb_j = cute.make_rmem_tensor(cute.make_layout((HC,)), Float32)
        for source in cutlass.range_constexpr(HC):
            comb_j[source] = cute.arch.load(
                (args.comb + (Int64(token) * HC + source) * HC + Int64(lane)).llvm_ptr, Float32
            )

        # Polled before the PDL wait (Lamport slots need no ordering); the wait comes before the
        # first output store, as an output may alias what the publish reads.
        polled = Boolean(True)
        reduced = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        if from_x:
            reduced.store(ptx.words_to_f32x8(protocol.load_x(args.x, token, column, hidden)))
            polled = Boolean(False)
            if poisoned:
                # A direct read's poison (the mailbox path's is in its poll): x reads as NaN.
                reduced.fill(Float32(float("nan")))
        else:
            mailbox_base = args.mailbox.iterator.toint()
            counter = stages.counts_tokens(token, cluster_rank, tidx, args.spin_limit_ns)
            poisoned = protocol.poll_and_sum(
                reduced,
                protocol.MailboxView(mailbox_base, stage, tp, args.capacity, hidden),
                protocol.Slots(token, token, fragment),
                protocol.RankLane(lane, HC, True),
                protocol.SpinBound(args.spin_limit_ns, args.error_flag, args.stage_state.iterator.toint()),
                poisoned,
                protocol.TokenCountCheck(tp > 1, counter, args.m),
            )
            protocol.rearm_slots(
                protocol.MailboxView(mailbox_base, stage, tp, args.capacity, hidden),
                protocol.Slots(token, token, fragment),
                protocol.RankLane(lane, HC, poisoned == Boolean(False)),
            )
        cute.arch.griddepcontrol_launch_dependents()

        # The all-reduced sublayer output is BF16, as the collective returns it.
        stream_words = stages.post_mix(
            reduced.load().to(BFloat16).to(Float32),
            post_j,
            lambda i: ptx.words_to_f32x8(streams[i, None].load()),
            lambda i: comb_j[i],
        )

        partials = cute.make_rmem_tensor(cute.make_layout((VALUES,)), Float32)
        fn_stage.wait(fn_barrier)
        group = tidx // HC
        terms = stages.gemv_partials(
            lambda row: fn_stage.load(fn_staged, Int32(row), lane, group, groups, FN_ROTATION_STREAMS),
            stream_words,
            config.mixed_fma,
        )
        for k in cutlass.range_constexpr(VALUES):
            partials[k] = terms[k]
        sums = stages.ClusterSums.allocate(smem, tidx, cluster_rank, 1, config.warps, cluster, token_major=True)
        store = None
        if cutlass.const_expr(fp8 is not None):
            store = Fp8Store.create(
                config, fp8, smem, args.layer_input, config.threads, 1, CUDA_CORE_FRAGMENTS_PER_WARP, HC
            )
        # One token: the (value, peer) pairs spread over the threads (``reduce.block_to_cluster``).
        reduce.block_to_cluster(partials, VALUES, sums.warp, sums.cluster, cluster_rank, config.threads, cluster)
        sums.cluster_totals()

        rstd = stages.mixes_rstd(sums.totals, hidden, config.rms_eps)
        if (cluster_rank == 0) & (tidx == 0):
            stages.write_raw_mixes(sums.totals, rstd, args.mixes_out, token)
        cute.arch.griddepcontrol_wait()
        stages.store_fragment(args.residual_out, stages.stream_element(token, lane, column, hidden), stream_words)
        pre = stages.pre_mix(sums.totals, rstd, lane, args.scale, args.base, Float32(config.hc_eps))
        prenorm_words = stages.collapse_streams(stream_words, pre)

        sums.square_over_warp(0, cute.arch.warp_idx(), prenorm_words, lane, config.mixed_fma)
        sums.squares_to_cluster()
        sum_square = sums.square_total(0)
        inv_rms = stages.inverse_rms(sum_square, hidden, config.norm_eps)
        if cutlass.const_expr(store is None):
            if lane == 0:
                result = ptx.words_to_f32x8(prenorm_words) * inv_rms * ptx.words_to_f32x8(gamma_words)
                stages.store_row(args.layer_input, token, column, hidden, result)
        else:
            # Every lane of the fragment's 4 computes it (the shuffles need the whole warp); lane 0 stores.
            words = store.fragment_words(prenorm_words, inv_rms, gamma_words)
            store.store_bf16(token, fragment, words, lane == 0)
            warp = cute.arch.warp_idx()
            absmax = store.warp_max(words)
            store.share(Int32(0), warp, absmax, cute.arch.lane_idx() == 0)
            store.exchange()
            absmax = store.group_max(Int32(0), warp, absmax)
            store.store(token, fragment, args.m, words, absmax, lane == 0)
            store.store_padding(args.m, cluster_rank, tidx, config.threads, cluster)
        stages.finish(
            tidx, args.stage_state, args.arrivals, stage, stages.group_count(args.m, 1), cluster_rank, polled, poisoned
        )
