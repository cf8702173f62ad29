"""Lamport hand-off of small FP32 rows from a main-stream kernel to a side-stream kernel
that runs alongside it (GLM's raw mixes, 24 per token, to the mixes kernel).

The side kernel is launched before its producer finishes (it waits only for what
came before the producer on the main stream), so it starts the moment a row is
there instead of one kernel launch after the producer ends. Like the mailbox, an
empty slot holds FP32 -0, so a row needs no flag and no fence:

- producer: ``write_row`` stores the values in 16-byte words with -0 turned into +0;
- consumer: ``wait_row`` polls the row with volatile 16-byte loads until no -0
  remains (bounded like every poll), then ``rearm_row`` stores -0 back. The next
  producer may only write after the consumer finished (the op joins the side
  stream first), so no round sees an old value.

Why not a ready flag: its release store is a fence that waits for the row's
stores to be acknowledged, and the consumer then needs a second round trip for
the row itself; a Lamport row arrives in one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from ..constants import ERROR_CODE, ERROR_HANDOFF_TIMEOUT, ERROR_TOKEN
from . import protocol, ptx

#: FP32 values per 16-byte word group.
WORD_VALUES = 4


@cute.jit
def _address(rows: Int64, index: Int32, width: cutlass.Constexpr[int], group: cutlass.Constexpr[int]) -> Int64:
    return rows + (Int64(index) * width + group * WORD_VALUES) * 4


@cute.jit
def write_row(rows: Int64, index: Int32, values: list, width: cutlass.Constexpr[int]) -> None:
    """Store row ``index``: ``values[:width]`` (FP32, ``width`` a multiple of 4; rows 16-byte aligned).

    -0 is stored as +0: the value is the same to every consumer's arithmetic, and -0
    marks an empty slot."""
    for group in cutlass.range_constexpr(width // WORD_VALUES):
        quad = cute.make_rmem_tensor(cute.make_layout((WORD_VALUES,)), Float32)
        for k in cutlass.range_constexpr(WORD_VALUES):
            quad[k] = values[group * WORD_VALUES + k]
        words = ptx.sanitize_negative_zero_f32(ptx.as_words(quad.load()))
        ptx.store_u32x4(_address(rows, index, width, group), words)


@cute.jit
def wait_row(
    values: cute.Tensor,
    rows: Int64,
    index: Int32,
    width: cutlass.Constexpr[int],
    spin_limit_ns: Int64,
    error_flag: Int64,
    state: Int64,
) -> Boolean:
    """Poll row ``index`` until no value is -0, into ``values`` (``width`` FP32 in registers).

    False if ``spin_limit_ns`` (> 0) passed first (reported in the host-mapped ``error_flag``
    as ``ERROR_HANDOFF_TIMEOUT`` for ``index``, and in the error word of the op's stage state at
    ``state``, which poisons every later kernel of the op). The producer always writes its row, also when it
    is poisoned or timed out itself (NaN values), so the bound is a backstop: the op gives
    it the producer's own bound and more (``mhc_core.host.calls.spin.SpinGuard.handoff_limit_ns``)."""
    groups = width // WORD_VALUES
    kept = cute.make_rmem_tensor(cute.make_layout((groups, WORD_VALUES), stride=(WORD_VALUES, 1)), Uint32)
    waiting = Boolean(True)
    arrived = Boolean(True)
    started = Int64(0)
    while waiting:
        waiting = Boolean(False)
        for group in cutlass.range_constexpr(groups):
            words = ptx.load_volatile_u32x4(_address(rows, index, width, group))
            waiting = waiting | ptx.has_negative_zero_f32(words)
            kept[group, None].store(words)
        if waiting & (spin_limit_ns > Int64(0)):
            started, expired = protocol.spin_clock(started, spin_limit_ns)
            if expired:
                ptx.store_system_u32(error_flag + Int64(ERROR_TOKEN * 4), Uint32(index))
                ptx.store_system_u32(error_flag + Int64(ERROR_CODE * 4), Uint32(ERROR_HANDOFF_TIMEOUT))
                protocol.set_error(state, ERROR_HANDOFF_TIMEOUT)
                arrived = Boolean(False)
                waiting = Boolean(False)
    for group in cutlass.range_constexpr(groups):
        quad = ptx.words_to_f32x4(kept[group, None].load())
        for k in cutlass.range_constexpr(WORD_VALUES):
            values[group * WORD_VALUES + k] = quad[k]
    return arrived


@cute.jit
def rearm_row(rows: Int64, index: Int32, width: cutlass.Constexpr[int]) -> None:
    """Mark row ``index`` empty again (FP32 -0 in every slot)."""
    for group in cutlass.range_constexpr(width // WORD_VALUES):
        ptx.store_u32x4(_address(rows, index, width, group), ptx.f32_sentinel_u32x4())
