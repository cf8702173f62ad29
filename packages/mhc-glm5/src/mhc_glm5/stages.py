"""The stages of the GLM-5.3 boundary kernels, each written once.

``mhc_glm5.boundary`` (one token per cluster), ``mhc_glm5.grouped`` (2-4 tokens, CUDA cores)
and ``mhc_glm5.grouped_mma`` (8 or 16 tokens, tensor cores; ``mhc_glm5.persistent`` loops its
stages over groups of 8) run the same stages in the same order: prologue (``begin``, the loads
and the staging), poll (``mhc_core.device.protocol``, ``counts_tokens``), post-mix, GEMV, the two
cluster reductions (``ClusterSums``), epilogue (``finish`` last). They differ in how a thread maps
to tokens, streams and fragments, so each kernel's ``body`` wires these functions together with
the indices of its mapping; the tensor-core kernel's own stages (its poll, post-mix, GEMV and
epilogue of a group) are methods that its grouped body and the persistent boundary share.

Written for byte-identical PTX with the kernels they came from (``tools.compile_presets
--ptx-digest``). A function here traces inline, so moving code into one changes nothing as
long as
- the operations keep their order, pure arithmetic included (the PTX follows it): a function
  that must not reorder its caller's work takes a callable or the caller's finished values;
- each dynamic ``if`` / loop carries the same variables: the DSL carries through a region every
  name the region assigns or calls a method on (``x.toint()``; frozen dataclasses excepted), and
  a carried ``cute.Tensor`` reads its iterator anew after the region, which moves that read;
- a stage takes ``tidx`` from its kernel rather than reading it: the first read fixes where the
  PTX reads the thread index, and a kernel left with no use of its own would move it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from mhc_core.constants import VEC_BF16, WARP_SIZE
from mhc_core.device import handoff, protocol, ptx, reduce
from mhc_core.device.fastmath import sigmoid

from .config import HC, MIX, MIX_INPUTS, VALUES


# ------------------------------------------------------------------ prologue
@cute.jit
def begin(prefetch: Int32, from_x: Boolean, stage_state: cute.Tensor) -> tuple:
    """``(stage, poisoned)``: the PDL wait first unless the publish runs right before (``prefetch``)
    and the mailbox is polled (a direct read of x waits: the kernel before wrote it), then the
    stage and the error word (``protocol.stage_before_wait``)."""
    if (prefetch == Int32(0)) | from_x:
        cute.arch.griddepcontrol_wait()
    # The stage and the error word first: the poll needs the stage, and a direct read's poison
    # select the error word, so their load is in flight while the prologue is issued.
    return protocol.stage_before_wait(stage_state)


@cute.jit
def stream_element(token: Int32, stream: Int32, column: Int64, hidden: cutlass.Constexpr[int]) -> Int64:
    """Element offset of stream ``stream``'s fragment at ``column`` of ``token`` in a
    ``[M, 4, hidden]`` tensor (``residual``, ``residual_out``)."""
    return (Int64(token) * HC + Int64(stream)) * hidden + column


@cute.jit
def load_fragment(tensor: cute.Pointer, element: Int64) -> cute.TensorSSA:
    """The 16-byte fragment of a BF16 tensor that starts at ``element``: 4 words."""
    return ptx.load_u32x4(tensor.toint() + element * 2)


@cute.jit
def store_fragment(tensor: cute.Pointer, element: Int64, words: cute.TensorSSA) -> None:
    """``words`` into the 16-byte fragment of a BF16 tensor that starts at ``element``."""
    ptx.store_u32x4(tensor.toint() + element * 2, words)


@cute.jit
def stage_mix_inputs(
    tidx: Int32,
    post: cute.Pointer,
    comb: cute.Pointer,
    mix_inputs: cute.Pointer,
    first: Int32,
    last: Int32,
    tokens: cutlass.Constexpr[int],
    threads: cutlass.Constexpr[int],
    asynchronous: cutlass.Constexpr[bool],
) -> None:
    """Every token's post (4) and comb (16) mixes into ``mix_inputs`` (``[tokens, 20]`` FP32 in shared
    memory), one value per thread and trip; a short last group repeats its last token.

    ``asynchronous``: 4-byte ``cp.async`` copies (their rows are only 4-byte aligned), committed
    as one group that the caller waits for; else loads and shared stores (visible after a barrier).
    """
    for trip in cutlass.range_constexpr(-(-(tokens * MIX_INPUTS) // threads)):
        index = tidx + trip * threads
        if index < Int32(tokens * MIX_INPUTS):
            t = index // MIX_INPUTS
            j = index % MIX_INPUTS
            row = Int64(cutlass.min(first + t, last))
            if cutlass.const_expr(asynchronous):
                address = comb.toint() + (row * (HC * HC) + Int64(j - HC)) * 4
                if j < Int32(HC):
                    address = post.toint() + (row * HC + Int64(j)) * 4
                ptx.copy_async_4(mix_inputs + index, address)
            else:
                value = Float32(0.0)
                if j < Int32(HC):
                    value = cute.arch.load((post + row * HC + Int64(j)).llvm_ptr, Float32)
                else:
                    value = cute.arch.load((comb + row * (HC * HC) + Int64(j - HC)).llvm_ptr, Float32)
                cute.arch.store((mix_inputs + index).llvm_ptr, value)
    if cutlass.const_expr(asynchronous):
        cute.arch.cp_async_commit_group()


# ------------------------------------------------------------------ poll
@cute.jit
def counts_tokens(block: Int32, cluster_rank: Int32, tidx: Int32, spin_limit_ns: Int64) -> Boolean:
    """Whether this thread checks every rank's published M (``protocol.poll_slots``' counter): the
    grid's first thread, when polls are bounded."""
    return (block == 0) & (cluster_rank == 0) & (tidx == 0) & (spin_limit_ns > Int64(0))


@cute.jit
def group_sum(value: Float32) -> Float32:
    """Sum over the 4 lanes of a group (xor butterfly: ``(v0 + v1) + (v2 + v3)`` in lane 0); every
    lane gets the total."""
    for step in cutlass.range_constexpr(HC.bit_length() - 1):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=1 << step, mask=-1, mask_and_clamp=31)
    return value


# ------------------------------------------------------------------ post-mix
def post_mix(
    summed: cute.TensorSSA,
    post: Float32,
    source: Callable[[int], cute.TensorSSA],
    comb: Callable[[int], Float32],
) -> cute.TensorSSA:
    """Stream ``j`` after the boundary: ``bf16(x * post[j] + sum_i s_i * comb[i, j])``, as words;
    ``summed`` is the all-reduced x (FP32 of its BF16), ``source(i)`` residual stream ``i`` (FP32)
    and ``comb(i)`` its weight: callables, read in the sum's order (each kernel holds them in its
    own place). A plain function: traced inline, its loop unrolled by Python."""
    mixed = summed * post
    for i in range(HC):
        mixed = mixed + source(i) * comb(i)
    return ptx.f32x8_to_words(mixed)


def post_mix_staged(
    summed: cute.TensorSSA, inputs: cute.Pointer, j: Int32, source: Callable[[int], cute.TensorSSA]
) -> cute.TensorSSA:
    """``post_mix`` of stream ``j`` with one token's post and comb from its staged mix inputs
    (``inputs``: the token's row of ``stage_mix_inputs``)."""
    return post_mix(
        summed,
        cute.arch.load((inputs + j).llvm_ptr, Float32),
        source,
        lambda i: cute.arch.load((inputs + HC + i * HC + j).llvm_ptr, Float32),
    )


# ------------------------------------------------------------------ GEMV
@cute.jit
def load_fn_rows(fn: cute.Pointer, lane: Int32, column: Int64, hidden: cutlass.Constexpr[int]) -> cute.Tensor:
    """The 24 ``fn`` fragments this lane multiplies with stream ``lane``: ``[24, 4]`` words."""
    rows = cute.make_rmem_tensor(cute.make_layout((MIX, 4), stride=(4, 1)), Uint32)
    for row in cutlass.range_constexpr(MIX):
        element = Int64(row) * (HC * hidden) + Int64(lane) * hidden + column
        rows[row, None].store(ptx.load_u32x4(fn.toint() + element * 2))
    return rows


def gemv_partials(row_fragment: Callable[[int], cute.TensorSSA], stream: cute.TensorSSA, mixed_fma: bool) -> list:
    """This fragment's 24 GEMV terms and its sum of squares (25 FP32 values); ``row_fragment(r)``
    is the lane's ``fn`` fragment of row ``r`` (from registers or from the staged slice). A plain
    function: traced inline, its loop unrolled by Python."""
    partial = [ptx.dot_bf16x8(row_fragment(row), stream, mixed_fma) for row in range(MIX)]
    partial.append(ptx.dot_bf16x8(stream, stream, mixed_fma))
    return partial


# ------------------------------------------------------------------ reductions
@dataclass(frozen=True)
class ClusterSums:
    """The two cluster reductions of a boundary kernel, for ``tokens`` tokens per cluster: the 25
    values per token (24 mixes and the streams' sum of squares: ``warp``, ``cluster``, ``totals``)
    and the RMSNorm's sum of squares per token (``warp_squares``, ``cluster_squares``), FP32 in
    shared memory (``allocate``), with the geometry they are reduced over. Every sum has one
    tree fixed at compile time (warps in index order, peers in rank order: ``mhc_core.device.reduce``).

    Layouts, for token ``t``, warp ``w`` / peer ``p``, value ``v``: ``token_major``, ``warp[t, w, v]``,
    ``cluster[t, p, v]``, ``warp_squares[t, w]``, ``cluster_squares[t, p]`` (the CUDA-core kernels,
    whose warps reduce one token at a time); else ``warp[w, t, v]``, ``cluster[p, t, v]``,
    ``warp_squares[w, t]``, ``cluster_squares[p, t]`` (the tensor-core kernel, whose warps hold every
    token at once); ``totals[t, v]`` in both. Two layouts, kept so that no kernel's PTX changed.

    Frozen: the DSL passes it into a dynamic region read-only (see the module docstring).
    """

    warp: cute.Pointer
    cluster: cute.Pointer
    totals: cute.Pointer
    warp_squares: cute.Pointer
    cluster_squares: cute.Pointer
    tidx: Int32
    cluster_rank: Int32
    tokens: int
    warps: int
    cluster_size: int
    token_major: bool

    @staticmethod
    def allocate(
        smem: cutlass.memory.SmemAllocator,
        tidx: Int32,
        cluster_rank: Int32,
        tokens: int,
        warps: int,
        cluster_size: int,
        token_major: bool,
        halves: int = 1,
    ) -> ClusterSums:
        """The scratch for ``tokens`` tokens, in this order in shared memory; ``halves`` copies of
        the peers' slots (``half``)."""
        return ClusterSums(
            smem.allocate_array(Float32, tokens * warps * VALUES),
            smem.allocate_array(Float32, halves * tokens * cluster_size * VALUES),
            smem.allocate_array(Float32, tokens * VALUES),
            smem.allocate_array(Float32, tokens * warps),
            smem.allocate_array(Float32, halves * tokens * cluster_size),
            tidx,
            cluster_rank,
            tokens,
            warps,
            cluster_size,
            token_major,
        )

    @cute.jit
    def values_over_warp(self, t: Int32, warp: Int32, values: list) -> None:
        """The warp's sums of token ``t``'s 25 values (``values``: this lane's), by one reduce-scatter
        (31 shuffles, not 25 butterflies of 5): lane ``i`` stores value ``i`` into ``warp``
        (token-major; the tensor-core kernel's MMA leaves its sums in the lanes instead)."""
        for _ in cutlass.range_constexpr(WARP_SIZE - VALUES):
            values.append(Float32(0.0))
        total = reduce.warp_reduce_scatter(values)
        if cute.arch.lane_idx() < Int32(VALUES):
            slot = self.warp + (t * self.warps + warp) * VALUES + cute.arch.lane_idx()
            cute.arch.store(slot.llvm_ptr, total)

    def half(self, values: Int32, squares: Int32) -> ClusterSums:
        """These sums with the peers' slots of half ``values`` (the 25 values) and half ``squares``
        (the sums of squares), of an ``allocate(..., halves=2)``: a loop whose one cluster barrier
        carries one group's values and the group before's squares alternates them, so that a peer
        already sending the next group's never writes the slots this CTA still reads."""
        return dataclasses.replace(
            self,
            cluster=self.cluster + values * (self.tokens * self.cluster_size * VALUES),
            cluster_squares=self.cluster_squares + squares * (self.tokens * self.cluster_size),
        )

    @cute.jit
    def values_to_cluster(self) -> None:
        """Block -> cluster for the 25 values of every token, once the warps' sums are in ``warp``:
        a CTA barrier; each (token, value) total of the CTA's warps into every peer's ``cluster``,
        one thread per (token, value) in trips; the cluster barrier; ``cluster_totals``.

        (The one-token kernel spreads (value, peer) pairs over its threads instead,
        ``reduce.block_to_cluster``, then takes ``cluster_totals``.)
        """
        cute.arch.barrier()
        self.send_values()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        self.cluster_totals()

    @cute.jit
    def send_values(self) -> None:
        """Each (token, value) total of the CTA's warps into every peer's ``cluster``, one thread per
        (token, value) in trips (after a CTA barrier; the cluster barrier follows)."""
        tidx, warps, cluster = self.tidx, self.warps, self.cluster_size
        threads = warps * WARP_SIZE
        pairs = self.tokens * VALUES
        for trip in cutlass.range_constexpr(-(-pairs // threads)):
            index = tidx + trip * threads
            if index < Int32(pairs):
                if cutlass.const_expr(self.token_major):
                    t = index // VALUES
                    v = index % VALUES
                    total = Float32(0.0)
                    for w in cutlass.range_constexpr(warps):
                        total = total + cute.arch.load((self.warp + (t * warps + w) * VALUES + v).llvm_ptr, Float32)
                    for peer in cutlass.range_constexpr(cluster):
                        slot = self.cluster + (t * cluster + self.cluster_rank) * VALUES + v
                        ptx.store_to_peer_f32(slot, Int32(peer), total)
                else:
                    total = Float32(0.0)
                    for w in cutlass.range_constexpr(warps):
                        total = total + cute.arch.load((self.warp + w * pairs + index).llvm_ptr, Float32)
                    for peer in cutlass.range_constexpr(cluster):
                        ptx.store_to_peer_f32(self.cluster + self.cluster_rank * pairs + index, Int32(peer), total)

    @cute.jit
    def cluster_totals(self) -> None:
        """After the cluster barrier: each (token, value) total over the cluster into ``totals``,
        one thread per (token, value) in trips; then a CTA barrier."""
        cluster = self.cluster_size
        threads = self.warps * WARP_SIZE
        pairs = self.tokens * VALUES
        for trip in cutlass.range_constexpr(-(-pairs // threads)):
            index = self.tidx + trip * threads
            if index < Int32(pairs):
                if cutlass.const_expr(self.token_major):
                    t = index // VALUES
                    v = index % VALUES
                    cute.arch.store(
                        (self.totals + index).llvm_ptr,
                        reduce.cluster_total(self.cluster + t * cluster * VALUES, v, VALUES, cluster),
                    )
                else:
                    cute.arch.store(
                        (self.totals + index).llvm_ptr, reduce.cluster_total(self.cluster, index, pairs, cluster)
                    )
        cute.arch.barrier()

    @cute.jit
    def square_over_warp(
        self, t: Int32, warp: Int32, words: cute.TensorSSA, lane: Int32, mixed_fma: cutlass.Constexpr[bool]
    ) -> None:
        """The warp's part of token ``t``'s RMSNorm sum of squares, where lane 0 of each 4-lane
        group holds a fragment (``words``) of the collapsed row: summed over the warp by a butterfly
        into ``warp_squares`` (token-major; the tensor-core kernel sums its own lanes' fragments)."""
        square = Float32(0.0)
        if lane == 0:
            square = ptx.dot_bf16x8(words, words, mixed_fma)
        square = reduce.warp_sum(square)
        if cute.arch.lane_idx() == 0:
            cute.arch.store((self.warp_squares + t * self.warps + warp).llvm_ptr, square)

    @cute.jit
    def squares_to_cluster(self) -> None:
        """Block -> cluster for one value per token, once the warps' sums are in ``warp_squares``: a
        CTA barrier; one thread per (token, peer) sends the CTA's total into that peer's
        ``cluster_squares``; the cluster barrier (then ``square_total``). Needs ``tokens * cluster``
        threads (the presets guarantee 25 x cluster_size)."""
        cute.arch.barrier()
        self.send_squares()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def send_squares(self) -> None:
        """One thread per (token, peer) sends the CTA's sum of squares of the token into that peer's
        ``cluster_squares`` (after a CTA barrier; the cluster barrier follows)."""
        tidx, tokens, warps, cluster = self.tidx, self.tokens, self.warps, self.cluster_size
        if tidx < Int32(tokens * cluster):
            t = tidx // cluster
            peer = tidx % cluster
            total = Float32(0.0)
            if cutlass.const_expr(self.token_major):
                for w in cutlass.range_constexpr(warps):
                    total = total + cute.arch.load((self.warp_squares + t * warps + w).llvm_ptr, Float32)
                ptx.store_to_peer_f32(self.cluster_squares + t * cluster + self.cluster_rank, peer, total)
            else:
                for w in cutlass.range_constexpr(warps):
                    total = total + cute.arch.load((self.warp_squares + w * tokens + t).llvm_ptr, Float32)
                ptx.store_to_peer_f32(self.cluster_squares + self.cluster_rank * tokens + t, peer, total)

    @cute.jit
    def square_total(self, t: Int32) -> Float32:
        """Token ``t``'s sum of squares over the cluster, peers in rank order."""
        if cutlass.const_expr(self.token_major):
            return reduce.cluster_total(self.cluster_squares + t * self.cluster_size, 0, 1, self.cluster_size)
        return reduce.cluster_total(self.cluster_squares, t, self.tokens, self.cluster_size)


# ------------------------------------------------------------------ epilogue
@cute.jit
def mixes_rstd(totals: cute.Pointer, hidden: cutlass.Constexpr[int], rms_eps: cutlass.Constexpr[float]) -> Float32:
    """``rsqrt(sum s^2 / (4 hidden) + rms_eps)`` from a token's 25 cluster totals (squares last)."""
    return cute.math.rsqrt(
        cute.arch.load((totals + MIX).llvm_ptr, Float32) / Float32(HC * hidden) + Float32(rms_eps), fastmath=True
    )


@cute.jit
def write_raw_mixes(totals: cute.Pointer, rstd: Float32, mixes_out: cute.Pointer, token: Int32):
    """One thread: the token's 24 raw mixes ``totals[r] * rstd``, handed off to the side-stream
    mixes kernel (``mhc_core.device.handoff``)."""
    raw = [cute.arch.load((totals + r).llvm_ptr, Float32) * rstd for r in range(MIX)]
    handoff.write_row(mixes_out.toint(), token, raw, MIX)


@cute.jit
def pre_mix(
    totals: cute.Pointer, rstd: Float32, j: Int32, scale: cute.Pointer, base: cute.Pointer, hc_eps: Float32
) -> Float32:
    """Stream ``j``'s pre weight from a token's cluster totals (``ClusterSums.totals[t]``):
    ``sigmoid(raw[j] * scale[0] + base[j]) + hc_eps``, ``raw[j] = totals[j] * rstd``."""
    mix = cute.arch.load((totals + j).llvm_ptr, Float32) * rstd
    return (
        sigmoid(mix * cute.arch.load(scale.llvm_ptr, Float32) + cute.arch.load((base + j).llvm_ptr, Float32)) + hc_eps
    )


@cute.jit
def collapse_streams(stream: cute.TensorSSA, pre: Float32) -> cute.TensorSSA:
    """``bf16((t0 + t1) + (t2 + t3))``, ``t_j = s_j * pre_j``, over the 4 lanes of a group."""
    collapse = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
    collapse.store(ptx.words_to_f32x8(stream) * pre)
    protocol.sum_over_lanes(collapse, HC)
    return ptx.f32x8_to_words(collapse.load())


@cute.jit
def inverse_rms(sum_square: Float32, hidden: cutlass.Constexpr[int], norm_eps: cutlass.Constexpr[float]) -> Float32:
    """The RMSNorm's ``rsqrt(sum x^2 / hidden + norm_eps)`` from the cluster's sum of squares."""
    return cute.math.rsqrt(sum_square / Float32(hidden) + Float32(norm_eps), fastmath=True)


@cute.jit
def store_row(
    tensor: cute.Pointer, token: Int32, column: Int64, hidden: cutlass.Constexpr[int], values: cute.TensorSSA
) -> None:
    """``bf16(values)`` (8 FP32) into the fragment at ``column`` of row ``token`` of a ``[M, hidden]``
    BF16 tensor (``layer_input``): the address first, then the rounding, as the kernels always did."""
    ptx.store_u32x4(tensor.toint() + (Int64(token) * hidden + column) * 2, ptx.f32x8_to_words(values))


@cute.jit
def group_count(m: Int32, tokens: cutlass.Constexpr[int]) -> Int32:
    """Groups of ``tokens`` tokens in a call of M tokens: the clusters of a grouped launch."""
    return (m + tokens - 1) // tokens


@cute.jit
def finish(
    tidx: Int32,
    stage_state: cute.Tensor,
    arrivals: cute.Tensor,
    stage: Uint32,
    clusters: Int32,
    cluster_rank: Int32,
    polled: Boolean,
    poisoned: Boolean,
) -> None:
    """The cluster arrives (its first thread); the grid's last cluster (of ``clusters``) moves the
    stage on (``protocol.advance_stage_after_all``): only after a poll (a direct read used no stage)
    and while the op is healthy."""
    leader = (cluster_rank == 0) & (tidx == 0) & polled & (poisoned == Boolean(False))
    protocol.advance_stage_after_all(stage_state, arrivals, stage, clusters, leader)
