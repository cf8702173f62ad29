"""The CTA's slice of ``fn`` staged in shared memory by bulk copies, started before the PDL wait.

Why not registers: measured on the H200 (hidden 4096, cluster 8), the 98 KB of ``fn``
a CTA loads through the load/store unit queued the mailbox poll behind it, and the
poll completed ~2 us after launch. Bulk copies (``ptx.bulk_copy``, the copy engine)
leave that queue free, and one instruction moves a whole row slice.

Layout: chunk ``c = row * 4 + stream`` holds ``fn[row, stream * hidden + the CTA's
columns]`` (``fragments`` 16-byte fragments); chunks are ``config.fn_chunk_words``
apart. The padding rotates consecutive chunks across the shared-memory banks: a
kernel names the rotation (``config.FN_ROTATION_*``) under which its quarter-warp
reads touch 8 distinct 16-byte bank groups.
"""

from __future__ import annotations

from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from mhc_core.constants import VEC_BF16, WARP_SIZE
from mhc_core.device import ptx

from .config import FN_CHUNKS, FN_STAGE_ALIGN, HC, fn_chunk_words


def allocate(smem: cutlass.memory.SmemAllocator, fragments: int, rotation: int) -> tuple:
    """The staged slice (``Uint32``) and its mbarrier, first in the kernel's shared memory."""
    staged = smem.allocate_array(Uint32, FN_CHUNKS * fn_chunk_words(fragments, rotation), byte_alignment=FN_STAGE_ALIGN)
    return staged, smem.allocate_array(Int64, 1, byte_alignment=8)


def slice_bytes(fragments: int) -> int:
    """Bytes the copies of a CTA's slice move: what its barrier expects."""
    return FN_CHUNKS * fragments * 16


@cute.jit
def arm(barrier: cute.Pointer, transaction_bytes: cutlass.Constexpr[int]) -> None:
    """Thread 0 initialises ``barrier`` for one phase of ``transaction_bytes`` (any bulk-copy
    staging's); a CTA barrier must follow before any copy names it."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        cute.arch.mbarrier_init(barrier, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.mbarrier_arrive_and_expect_tx(barrier, transaction_bytes)


@cute.jit
def expect(barrier: cute.Pointer, transaction_bytes: cutlass.Constexpr[int]) -> None:
    """Thread 0 arms the next phase of ``barrier`` for ``transaction_bytes``, once every thread has
    waited on the phase before, and before a CTA barrier that precedes the copies that complete it
    (``copy_rows``: any thread may issue one)."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(barrier, transaction_bytes)


@cute.jit
def copy_rows(
    source: cute.Pointer,
    element: Callable[[Int32], Int64],
    slot: Callable[[Int32], cute.Pointer],
    rows: cutlass.Constexpr[int],
    row_bytes: cutlass.Constexpr[int],
    barrier: cute.Pointer,
    threads: cutlass.Constexpr[int],
    every_warp: cutlass.Constexpr[bool],
) -> None:
    """Start one bulk copy per row ``r < rows``, against an armed ``barrier``: ``row_bytes`` from
    element ``element(r)`` of the BF16 tensor ``source`` to ``slot(r)`` in shared memory. Any
    staging's (the ``fn`` slice here, the tensor-core kernel's residual streams); the callables
    give its addressing.

    Who issues them: a warp's bulk-copy instruction issues its lanes' copies one after another,
    ~60 cycles each on the H200 (BENCHMARKS.md, thirteenth run): 32 rows held one warp ~1 us, two
    rows from each of 16 warps were all issued ~0.2 us after the first.
    - ``every_warp``: row ``r`` from warp ``r % warps`` (every thread may issue one, so the phase
      must be armed before a CTA barrier that precedes this call). For a kernel whose warps all
      wait for these rows next (the tensor-core kernels).
    - else consecutive threads, as few warps as can: the others go on meanwhile (the one-token
      kernel's warps poll; spread there, its M = 8 call measured 1.8 % slower)."""
    tidx, _, _ = cute.arch.thread_idx()
    warps = threads // WARP_SIZE
    if cutlass.const_expr(every_warp):
        per_warp = -(-rows // warps)
        trips = -(-per_warp // WARP_SIZE)

        def row_of(trip: int) -> Int32:
            return (tidx % WARP_SIZE + trip * WARP_SIZE) * warps + tidx // WARP_SIZE
    else:
        trips = -(-rows // threads)

        def row_of(trip: int) -> Int32:
            return tidx + trip * threads

    for trip in cutlass.range_constexpr(trips):
        row = row_of(trip)
        if row < Int32(rows):
            offset = element(row)
            ptx.bulk_copy(slot(row), source.toint() + offset * 2, Int32(row_bytes), barrier)


@cute.jit
def copy(
    fn: cute.Pointer,
    staged: cute.Pointer,
    barrier: cute.Pointer,
    first_fragment: Int32,
    fragments: cutlass.Constexpr[int],
    rotation: cutlass.Constexpr[int],
    hidden: cutlass.Constexpr[int],
    threads: cutlass.Constexpr[int],
    every_warp: cutlass.Constexpr[bool],
) -> None:
    """Start the copies of ``fn``'s columns ``[first_fragment, + fragments)`` (in fragments) into
    ``staged`` (``Uint32``), against an armed ``barrier``; ``every_warp`` as ``copy_rows``."""
    stride = fn_chunk_words(fragments, rotation)

    def element(chunk: Int32) -> Int64:
        row = chunk // HC
        stream = chunk % HC
        return Int64(row) * (HC * hidden) + Int64(stream) * hidden + Int64(first_fragment) * VEC_BF16

    copy_rows(
        fn, element, lambda chunk: staged + chunk * stride, FN_CHUNKS, fragments * 16, barrier, threads, every_warp
    )


@cute.jit
def wait(barrier: cute.Pointer, phase: Int32 = 0) -> None:
    """Until every chunk has landed: the barrier's first phase (``fn``, copied once), or the phase
    of parity ``phase`` (a reused staging buffer)."""
    cute.arch.mbarrier_wait(barrier, phase)


@cute.jit
def load(
    staged: cute.Pointer,
    row: Int32,
    stream: Int32,
    fragment: Int32,
    fragments: cutlass.Constexpr[int],
    rotation: cutlass.Constexpr[int],
) -> cute.TensorSSA:
    """Fragment ``fragment`` (of the CTA's) of ``fn[row, stream * hidden + ...]``: 4 words."""
    return ptx.load_shared_u32x4(staged + (row * HC + stream) * fn_chunk_words(fragments, rotation) + fragment * 4)
