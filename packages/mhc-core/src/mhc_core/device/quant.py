"""FP8 E4M3 quantisation of the layer input in registers (issue #33): the math every boundary kernel shares.

The numbers are ``mhc_core.fp8``'s (its module docstring, steps 1-4; ``docs/fp8-layouts.md``), and a
kernel built from these functions matches its torch references bit for bit. Per group of ``group``
consecutive columns of a row (the BF16 layer input, as the kernel rounds it to store it):

1. ``a = max(max |x_i|, fp32(1e-10))``: exact. The magnitudes are compared as integers (BF16 bits
   without the sign; a BF16 widens to FP32 exactly), so a NaN (its magnitude bits exceed every
   finite one's) wins the maximum instead of being dropped as ``max.f32`` drops it;
2. ``s = a / 448``: one IEEE division (``div.rn.f32``);
3. FP32 encoding: the scale is ``s``. UE8M0: the smallest power of two ``>= max(s, fp32(1e-10))``, as
   its biased exponent byte (the FP32 exponent field, plus one if any mantissa bit is set);
4. ``q_i = e4m3(x_i / scale)``: the IEEE quotient by an FP32 scale (``quantize_fragment_divide``:
   one shared reciprocal and ``div.rn``'s fast path per value, equal to ``div.rn.f32`` on every
   value a group holds); a multiply by ``2^-k`` for a UE8M0
   scale ``2^k`` (exact, so it rounds as the division does: both are the correctly rounded
   ``x_i * 2^-k``); then ``cvt.rn.satfinite.e4m3x2.f32``, which saturates at +-448 (the reference's
   clamp: checked equal on the H200 with and without it) and rounds to nearest even. ``-0`` gives
   code ``0x80``; an all-zero group scale ``fp32(1e-10) / 448`` (FP32) or ``2^-33`` (byte 94).

NaN (a poisoned op: every value of its layer input is NaN; ``mhc_core.fp8``'s references refuse
non-finite input, so this is the kernels' rule): a group holding a NaN gets a NaN scale (FP32: the
canonical ``0x7FFFFFFF``; UE8M0: byte ``0xFF``, E8M0's NaN) and NaN codes (``0x7F``) wherever its
values are NaN; with a NaN FP32 or UE8M0 scale every code of the group is NaN. Padding bytes stay 0.

Lanes. A *fragment* is 8 BF16 values in 4 packed words (``mhc_core.device.ptx``: half ``2k`` is the
low half of word ``k``). A kernel places each group's ``group / 8`` fragments in one aligned segment
of consecutive lanes of a warp, ``lanes`` lanes per fragment (the fragment's first lane holds its
words, the others zeros): ``segment_max`` then reduces the group with ``log2(group / 8)`` shuffles and
leaves its absmax in every lane of the segment. No shared memory, no barrier.

Scale layouts (``mhc_core.fp8``: ``row-major``, ``mn-major-packed``, ``swizzled-128x4``): the byte
address of (row ``token``, group ``g``), and the padding (bytes of groups past ``G`` in the last
word of a row, and rows ``M ..`` up to the layout's row alignment) that the kernel writes as zeros,
so the host allocates the scales with ``torch.empty``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ..constants import MAGNITUDE_BF16_PAIR, VEC_BF16
from . import ptx

#: Largest finite E4M3 magnitude (``mhc_core.fp8.E4M3_MAX``).
E4M3_MAX = 448.0
#: FP32 bits of ``fp32(1e-10)``: the absmax floor (``mhc_core.fp8.EPS``) and the UE8M0 scale floor
#: (``mhc_core.fp8.UE8M0_FLOOR``). Non-negative FP32 values order as their bits.
ABSMAX_FLOOR_BITS = 0x2EDBE6FF
UE8M0_FLOOR_BITS = 0x2EDBE6FF
#: FP32 layout: the exponent field's shift, the mantissa bits, the exponent bias.
F32_EXPONENT_SHIFT = 23
F32_MANTISSA = 0x7FFFFF
F32_EXPONENT_BIAS = 127
#: The canonical FP32 NaN (what ``div.rn.f32`` returns for a NaN operand).
F32_NAN_BITS = 0x7FFFFFFF
#: E8M0's NaN: the exponent byte of a NaN scale (and the largest code).
UE8M0_NAN = 0xFF
#: The upper BF16 of a bf16x2 word as FP32 bits (the lower one is ``word << 16``).
BF16_HIGH_HALF = 0xFFFF0000
BF16_BITS = 16
#: Bytes of one E4M3 code, and of a 4-byte scale word.
E4M3_BYTES = 1
SCALE_WORD_BYTES = 4
#: Groups per scale word in the UE8M0 layouts (four exponent bytes per int32).
GROUPS_PER_WORD = 4
#: ``mn-major-packed``: rows align to 4 (16 bytes of int32: DeepGEMM's TMA alignment).
PACKED_ROW_ALIGN = 4
#: ``swizzled-128x4``: 128-row by 4-group tiles of 512 bytes; row ``r`` of a tile at
#: ``(r % 32) * 16 + (r // 32) * 4``.
SWIZZLE_TILE_ROWS = 128
SWIZZLE_TILE_BYTES = 512
SWIZZLE_ROW_PERIOD = 32
SWIZZLE_ROW_BYTES = 16

#: The layouts, by ``mhc_core.fp8.Fp8Format.layout``.
ROW_MAJOR = "row-major"
MN_MAJOR_PACKED = "mn-major-packed"
SWIZZLED_128X4 = "swizzled-128x4"
LAYOUTS = (ROW_MAJOR, MN_MAJOR_PACKED, SWIZZLED_128X4)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ the group's absmax
@cute.jit
def fragment_absmax_bits(words: cute.TensorSSA) -> Uint32:
    """FP32 bits of ``max |x|`` over a fragment's 8 BF16 values (4 words, as the lane holds them).

    Integer maxima of the magnitude bits: exact, NaN-propagating (a NaN's bits exceed infinity's
    and every finite value's). A lane without a fragment passes zeros and gets 0 (+0.0).
    """
    magnitudes = words & Uint32(MAGNITUDE_BF16_PAIR)
    pairs = ptx.max_u16x2(
        ptx.max_u16x2(ptx.element(magnitudes, 0), ptx.element(magnitudes, 1)),
        ptx.max_u16x2(ptx.element(magnitudes, 2), ptx.element(magnitudes, 3)),
    )
    return cutlass.max(pairs & Uint32(BF16_HIGH_HALF), pairs << Uint32(BF16_BITS))


@cute.jit
def segment_max(bits: Uint32, lanes: cutlass.Constexpr[int], steps: cutlass.Constexpr[int]) -> Uint32:
    """Maximum of ``bits`` (non-negative FP32 bits) over an aligned segment of ``lanes << steps``
    lanes: xor butterfly at offsets ``lanes, 2 lanes, ...``; every lane of the segment gets it.

    Every lane of the warp must call it (full-mask shuffles); segments are independent.
    """
    for step in cutlass.range_constexpr(steps):
        other = cute.arch.shuffle_sync_bfly(bits, offset=lanes << step, mask=-1, mask_and_clamp=31)
        bits = cutlass.max(bits, Uint32(other))
    return bits


# ------------------------------------------------------------------ scales
@cute.jit
def group_scale(absmax_bits: Uint32) -> Float32:
    """The group's FP32 scale ``max(absmax, 1e-10) / 448`` (an IEEE division), from its absmax bits.

    The floor is an integer maximum of the bits, so a NaN absmax stays NaN (and so does the scale).
    """
    floored = cutlass.max(absmax_bits, Uint32(ABSMAX_FLOOR_BITS))
    return ptx.div_rn_f32(ptx.f32_from_bits(floored), Float32(E4M3_MAX))


@cute.jit
def ue8m0_exponent(scale: Float32) -> Uint32:
    """Biased exponent byte of the smallest power of two ``>= max(scale, 1e-10)``: the exponent
    field, plus one if any mantissa bit is set (exact: the reference's rule). A NaN scale gives
    ``UE8M0_NAN`` (its field, 255, plus one, saturated)."""
    bits = cutlass.max(ptx.f32_to_bits(scale), Uint32(UE8M0_FLOOR_BITS))
    exponent = bits >> Uint32(F32_EXPONENT_SHIFT)
    rounded_up = Uint32(cutlass.select_((bits & Uint32(F32_MANTISSA)) != Uint32(0), Uint32(1), Uint32(0)))
    return cutlass.min(exponent + rounded_up, Uint32(UE8M0_NAN))


@cute.jit
def ue8m0_reciprocal(exponent: Uint32) -> Float32:
    """``2^(127 - exponent)``, the exact reciprocal of a UE8M0 scale (``exponent`` in [94, 254]: the
    result is a normal FP32); NaN for ``UE8M0_NAN``."""
    bits = (Uint32(2 * F32_EXPONENT_BIAS) - exponent) << Uint32(F32_EXPONENT_SHIFT)
    bits = Uint32(cutlass.select_(exponent == Uint32(UE8M0_NAN), Uint32(F32_NAN_BITS), bits))
    return ptx.f32_from_bits(bits)


# ------------------------------------------------------------------ values
@cute.jit
def _pack_e4m3x8(values: list) -> tuple:
    """8 FP32 values -> 2 words of E4M3 codes, value ``k`` in byte ``k % 4`` of word ``k // 4``."""
    pairs = [ptx.cvt_e4m3x2(values[2 * k + 1], values[2 * k]) for k in range(VEC_BF16 // 2)]
    return pairs[0] | (pairs[1] << Uint32(BF16_BITS)), pairs[2] | (pairs[3] << Uint32(BF16_BITS))


@cute.jit
def quantize_fragment_divide(words: cute.TensorSSA, scale: Float32) -> tuple:
    """A fragment's 8 BF16 values (4 words) -> 2 words of ``e4m3(x / scale)``, each quotient the
    IEEE one (an FP32 scale: ``fp32-g128``). Byte ``k`` of the 8 is value ``k``.

    Eight ``div.rn.f32`` each check their operands and branch, one after the other: on a one-token
    kernel's tail that cost more than the rest of the quantisation. A normal scale (every group's but
    a NaN or infinite one's: the absmax floor keeps it above ``2^-43``, and ``|x| <= 448 * scale``)
    takes one shared reciprocal and ``div.rn``'s own fast path per value
    (``ptx.div_refined_f32``), exact wherever the code can be nonzero (``tests/core``'s exhaustive
    GPU check); any other scale takes ``div.rn.f32``.
    """
    values = ptx.words_to_f32x8(words)
    quotients = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
    exponent = (ptx.f32_to_bits(scale) >> Uint32(F32_EXPONENT_SHIFT)) & Uint32(UE8M0_NAN)
    if (exponent != Uint32(0)) & (exponent != Uint32(UE8M0_NAN)):
        reciprocal = ptx.rcp_refined_f32(scale)
        for k in cutlass.range_constexpr(VEC_BF16):
            quotients[k] = ptx.div_refined_f32(ptx.element(values, k), scale, reciprocal)
    else:
        for k in cutlass.range_constexpr(VEC_BF16):
            quotients[k] = ptx.div_rn_f32(ptx.element(values, k), scale)
    return _pack_e4m3x8([quotients[k] for k in range(VEC_BF16)])


@cute.jit
def quantize_fragment_scaled(words: cute.TensorSSA, reciprocal: Float32) -> tuple:
    """A fragment's 8 BF16 values -> 2 words of ``e4m3(x * reciprocal)``, ``reciprocal`` the exact
    ``2^-k`` of a UE8M0 scale ``2^k`` (equal to the division, see the module docstring)."""
    values = ptx.words_to_f32x8(words) * reciprocal
    return _pack_e4m3x8([ptx.element(values, k) for k in range(VEC_BF16)])


# ------------------------------------------------------------------ layouts
@cute.jit
def padded_rows(layout: cutlass.Constexpr[str], m: Int32) -> Int32:
    """Rows of the scale layout for ``m`` tokens: ``m``, ``align(m, 4)`` or ``align(m, 128)``."""
    align = 1
    if cutlass.const_expr(layout == MN_MAJOR_PACKED):
        align = PACKED_ROW_ALIGN
    elif cutlass.const_expr(layout == SWIZZLED_128X4):
        align = SWIZZLE_TILE_ROWS
    # The alignments are powers of two and m >= 1: a mask, not a signed division on the kernel's tail.
    return (m + Int32(align - 1)) & Int32(-align)


@cute.jit
def scale_offset(
    layout: cutlass.Constexpr[str], row: Int32, group: Int32, m: Int32, groups: cutlass.Constexpr[int]
) -> Int64:
    """Byte offset of the scale of (``row``, ``group``) (``groups`` scales per row), as
    ``mhc_core.fp8.Fp8Format.scale_offset`` computes it; ``group`` may run past ``groups`` up to the
    end of its scale word (the padding bytes of the UE8M0 layouts)."""
    if cutlass.const_expr(layout == ROW_MAJOR):
        offset = (Int64(row) * groups + Int64(group)) * SCALE_WORD_BYTES
    elif cutlass.const_expr(layout == MN_MAJOR_PACKED):
        word = Int64(group // Int32(GROUPS_PER_WORD)) * Int64(padded_rows(layout, m)) + Int64(row)
        offset = word * SCALE_WORD_BYTES + Int64(group % Int32(GROUPS_PER_WORD))
    else:
        tile = Int64(row // Int32(SWIZZLE_TILE_ROWS)) * _ceil_div(groups, GROUPS_PER_WORD)
        tile = tile + Int64(group // Int32(GROUPS_PER_WORD))
        within = (row % Int32(SWIZZLE_ROW_PERIOD)) * Int32(SWIZZLE_ROW_BYTES)
        within = within + (row % Int32(SWIZZLE_TILE_ROWS)) // Int32(SWIZZLE_ROW_PERIOD) * Int32(SCALE_WORD_BYTES)
        offset = tile * SWIZZLE_TILE_BYTES + Int64(within) + Int64(group % Int32(GROUPS_PER_WORD))
    return offset


@cute.jit
def store_group_scale(
    layout: cutlass.Constexpr[str],
    scales: Int64,
    row: Int32,
    group: Int32,
    m: Int32,
    groups: cutlass.Constexpr[int],
    code: Uint32,
) -> None:
    """Store one group's scale: ``code`` is the FP32 scale's bits (``row-major``) or the UE8M0
    exponent byte. The lane of the last group (``groups - 1``) also zeroes the padding bytes after
    it in its scale word (UE8M0 layouts with ``groups % 4 != 0``)."""
    address = scales + scale_offset(layout, row, group, m, groups)
    if cutlass.const_expr(layout == ROW_MAJOR):
        ptx.store_u32(address, code)
    else:
        ptx.store_u8(address, code)
        if cutlass.const_expr(groups % GROUPS_PER_WORD != 0):  # noqa: SIM102 (a compile-time branch stands alone in the DSL)
            if group == Int32(groups - 1):
                for pad in cutlass.range_constexpr(groups % GROUPS_PER_WORD, GROUPS_PER_WORD):
                    ptx.store_u8(address + (pad - groups % GROUPS_PER_WORD + 1), Uint32(0))


@cute.jit
def store_padding_rows(
    layout: cutlass.Constexpr[str], scales: Int64, m: Int32, thread: Int32, threads: Int32,
    groups: cutlass.Constexpr[int],
) -> None:  # fmt: skip
    """Zero the scale words of padding rows ``m .. padded_rows(m) - 1``, shared by ``threads`` threads
    of the launch (``thread``: this one's index among them, e.g. ``cluster * cluster_threads +
    rank * threads + tidx`` over the grid's clusters). Every thread calls it once, after the PDL wait,
    where few values are live: per token, unrolled, it cost a tensor-core kernel 2 us even at an M
    with no padding rows (a runtime division by M per token, and the code beside the token loop).

    ``swizzled-128x4`` zeroes whole 16-byte units (``_zero_swizzled_padding``), ``mn-major-packed``
    (at most 3 rows) one 4-byte word per padding row and word (``_zero_packed_padding``). Neither
    divides by M. Nothing for ``row-major``. No store touches a byte of a real row's scales.
    """
    if cutlass.const_expr(layout == SWIZZLED_128X4):
        _zero_swizzled_padding(scales, m, thread, threads, groups)
    elif cutlass.const_expr(layout == MN_MAJOR_PACKED):
        _zero_packed_padding(layout, scales, m, thread, threads, groups)


@cute.jit
def _zero_packed_padding(
    layout: cutlass.Constexpr[str], scales: Int64, m: Int32, thread: Int32, threads: Int32,
    groups: cutlass.Constexpr[int],
) -> None:  # fmt: skip
    """``mn-major-packed``: one 4-byte store per padding row and scale word. The padding rows of a
    word are consecutive words in memory (MN-major), so item ``i`` is word ``i // 4``, row ``m + i % 4``
    (rows past the padding skip): neighbouring threads store neighbouring words."""
    words_per_row = _ceil_div(groups, GROUPS_PER_WORD)
    padding = padded_rows(layout, m) - m
    for item in range(thread, words_per_row * PACKED_ROW_ALIGN, threads):
        row = item % Int32(PACKED_ROW_ALIGN)
        if row < padding:
            word = item // Int32(PACKED_ROW_ALIGN)
            offset = scale_offset(layout, m + row, word * Int32(GROUPS_PER_WORD), m, groups)
            ptx.store_u32(scales + offset, Uint32(0))


@cute.jit
def _zero_swizzled_padding(
    scales: Int64, m: Int32, thread: Int32, threads: Int32, groups: cutlass.Constexpr[int]
) -> None:
    """``swizzled-128x4``: the padding rows all lie in the last 128-row tile, which holds ``k``
    real rows. The tile is an array of 16-byte units, unit ``u`` at ``u * 16``: in each 4-group
    block of 512 bytes, unit ``r`` (``u % 32``) holds rows ``r``, ``r + 32``, ``r + 64`` and ``r + 96``
    (4 bytes each). A unit whose rows are all padding (``r >= k``) takes one 16-byte store; a unit
    that also holds real rows one 4-byte store per padding row, so no store touches a byte a real
    row's scale takes. Unit ``u`` goes to thread ``u % threads``: a warp's stores are 512
    consecutive bytes, whole sectors. (Units strided over the blocks left every 16-byte store half a
    sector: at M = 1, 127 padding rows, DSV's mx-g32 op spent 0.3 us on them.)"""
    blocks = _ceil_div(groups, GROUPS_PER_WORD)
    tile_rows = Int32(SWIZZLE_TILE_ROWS)
    last_tile = (m - Int32(1)) // tile_rows
    real = m - last_tile * tile_rows  # k, in 1..128
    tile = scales + Int64(last_tile) * (blocks * SWIZZLE_TILE_BYTES)
    zeros = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
    zeros.fill(Uint32(0))
    for unit in range(thread, blocks * SWIZZLE_ROW_PERIOD, threads):
        r = unit % Int32(SWIZZLE_ROW_PERIOD)
        address = tile + Int64(unit) * SWIZZLE_ROW_BYTES
        if r >= real:
            ptx.store_u32x4(address, zeros.load())
        else:
            for part in cutlass.range_constexpr(1, SWIZZLE_TILE_ROWS // SWIZZLE_ROW_PERIOD):
                if r + Int32(part * SWIZZLE_ROW_PERIOD) >= real:
                    ptx.store_u32(address + part * SCALE_WORD_BYTES, Uint32(0))
