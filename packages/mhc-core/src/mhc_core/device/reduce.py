"""FP32 reductions: warp -> block -> cluster, in a fixed order.

Every sum here has one tree fixed at compile time (xor butterfly, or for many values
a reduce-scatter, within a warp; warps in index order, cluster peers in rank order), so every CTA of a cluster and
every TP rank computes bit-identical totals from identical inputs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..constants import WARP_SIZE
from .ptx import store_to_peer_f32


@cute.jit
def warp_sum(value: Float32) -> Float32:
    """Sum over the 32 lanes; every lane gets the total."""
    for step in cutlass.range_constexpr(5):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=1 << step, mask=-1, mask_and_clamp=31)
    return value


@cute.jit
def warp_reduce_scatter(values: list) -> Float32:
    """Sum 32 per-lane values over the warp; lane ``i`` returns the total of value ``i``.

    Five halving steps: at width ``w`` a lane keeps the half of its list selected
    by its lane bit ``w`` and adds its partner's copy of that half (31 shuffles
    for 32 sums instead of 160).
    """
    lane = cute.arch.lane_idx()
    for step in cutlass.range_constexpr(5):
        width = WARP_SIZE >> (step + 1)
        upper = (lane & Int32(width)) != Int32(0)
        kept = []
        for i in cutlass.range_constexpr(width):
            low, high = values[i], values[i + width]
            sent = Float32(cutlass.select_(upper, low, high))
            kept.append(
                Float32(cutlass.select_(upper, high, low))
                + cute.arch.shuffle_sync_bfly(sent, offset=width, mask=-1, mask_and_clamp=31)
            )
        values = kept
    return values[0]


@cute.jit
def block_to_cluster(
    values: cute.Tensor,
    count: cutlass.Constexpr[int],
    warp_sums: cute.Pointer,
    cluster_sums: cute.Pointer,
    cluster_rank: Int32,
    threads: cutlass.Constexpr[int],
    cluster_size: cutlass.Constexpr[int],
) -> None:
    """Sum ``values[0:count]`` over the CTA into every peer's ``cluster_sums[cluster_rank, k]``.

    Scratch: ``warp_sums`` is ``[warps, count]`` FP32, ``cluster_sums`` is
    ``[cluster_size, count]`` FP32 in every CTA of the cluster. Ends with a
    cluster barrier, after which ``cluster_total`` may read. Each (value, peer)
    pair is sent by one thread, looping when there are more pairs than threads.
    """
    warps = threads // WARP_SIZE
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    if cutlass.const_expr(count * 5 > WARP_SIZE - 1):
        # Many values: one reduce-scatter (31 shuffles) instead of a butterfly (5) per value.
        assert count <= WARP_SIZE, "block_to_cluster reduces at most 32 values"
        padded = [values[k] for k in range(count)] + [Float32(0.0)] * (WARP_SIZE - count)
        lane_total = warp_reduce_scatter(padded)
        if lane < count:
            cute.arch.store((warp_sums + warp * count + lane).llvm_ptr, lane_total)
    else:
        for k in cutlass.range_constexpr(count):
            values[k] = warp_sum(values[k])
        if lane == 0:
            for k in cutlass.range_constexpr(count):
                cute.arch.store((warp_sums + warp * count + k).llvm_ptr, values[k])
    cute.arch.barrier()
    pairs = count * cluster_size
    for trip in cutlass.range_constexpr(-(-pairs // threads)):
        pair = tidx + trip * threads
        if pair < pairs:
            k = pair % count
            peer = pair // count
            total = Float32(0.0)
            for w in cutlass.range_constexpr(warps):
                total = total + cute.arch.load((warp_sums + w * count + k).llvm_ptr, Float32)
            store_to_peer_f32(cluster_sums + cluster_rank * count + k, peer, total)
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.jit
def cluster_total(
    cluster_sums: cute.Pointer, k: Int32, count: cutlass.Constexpr[int], cluster_size: cutlass.Constexpr[int]
) -> Float32:
    """Total of value ``k`` over the cluster, peers in rank order."""
    total = Float32(0.0)
    for peer in cutlass.range_constexpr(cluster_size):
        total = total + cute.arch.load((cluster_sums + peer * count + k).llvm_ptr, Float32)
    return total
