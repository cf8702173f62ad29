"""Device primitives: every inline-PTX instruction the kernels use, and the bit tricks.

One ``@dsl_user_op`` per instruction, keyword-only ``loc``/``ip`` passed through,
``has_side_effects=True`` on everything that orders memory or polls. This is the
only module of the library that holds PTX text; ``cute.arch`` is used wherever it
already has the operation (timers, PDL, DSMEM mapping, barriers).

A 16-byte *fragment* is 8 BF16 values, handled as 4 packed ``u32`` words in a
``TensorSSA`` of shape ``(4,)``: half ``2k`` is the low half of word ``k``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cutlass_dsl import T, dsl_user_op

from ..constants import MAGNITUDE_BF16_PAIR, NAN_BF16_PAIR, NEGATIVE_ZERO_BF16_PAIR, NEGATIVE_ZERO_F32, VEC_BF16

#: Bit 15 of both halves: the BF16 sign bits of a bf16x2 word.
SIGN_BF16_PAIR = 0x80008000
#: The sign bit of an FP32 word, and the other 31 bits.
SIGN_F32 = NEGATIVE_ZERO_F32
MAGNITUDE_F32 = 0x7FFFFFFF
#: PTX text of each instruction, named so tests can look for it in compiled PTX.
PTX_LOAD_U32X4 = "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];"
PTX_LOAD_VOLATILE_U32X4 = "ld.volatile.global.v4.u32 {$0, $1, $2, $3}, [$4];"
PTX_STORE_U32X4 = "st.global.v4.u32 [$0], {$1, $2, $3, $4};"
PTX_MULTIMEM_STORE_BF16X8 = "multimem.st.relaxed.sys.global.v4.bf16x2 [$0], {$1, $2, $3, $4};"
PTX_LOAD_VOLATILE_U32 = "ld.volatile.global.u32 $0, [$1];"
PTX_LOAD_VOLATILE_U32X2 = "ld.volatile.global.v2.u32 {$0, $1}, [$2];"
PTX_STORE_U32 = "st.global.u32 [$0], $1;"
PTX_STORE_SYSTEM_U32 = "st.relaxed.sys.global.u32 [$0], $1;"
PTX_ARRIVE_U32 = "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;"


def _value(x, loc, ip) -> ir.Value:
    return x.ir_value(loc=loc, ip=ip)


def _words_ssa(struct: ir.Value, *, loc=None, ip=None) -> cute.TensorSSA:
    words = [llvm.extractvalue(T.i32(), struct, [k], loc=loc, ip=ip) for k in range(4)]
    vec = vector.from_elements(ir.VectorType.get([4], T.i32()), words, loc=loc, ip=ip)
    return cute.TensorSSA(vec, (4,), Uint32)


def _elements(values: cute.TensorSSA, *, loc=None, ip=None) -> list[ir.Value]:
    # A plain vector extract: ``values[k]`` builds layout arithmetic that the DSL may share
    # between branches, which fails verification when a branch used it first.
    vec = values.ir_value(loc=loc, ip=ip)
    return [vector.extract(vec, [], [k], loc=loc, ip=ip) for k in range(values.shape[0])]


@dsl_user_op
def element(values: cute.TensorSSA, k: int, *, loc=None, ip=None):
    """Element ``k`` of a small register vector (a fragment's word, an accumulator)."""
    return values.dtype(_elements(values, loc=loc, ip=ip)[k])


# --------------------------------------------------------------------------- loads
def _load_words(text: str, count: int, address: Int64, volatile: bool, loc, ip) -> ir.Value:
    """One global load of ``count`` words at ``address``, as an LLVM struct; a volatile one has side
    effects and a memory clobber, which keep it inside a spin loop (a pure asm load would be
    hoisted out of it, and the loop would never see a peer's store)."""
    return llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * count),
        [_value(Int64(address), loc, ip)],
        text,
        ",".join(["=r"] * count + ["l"] + (["~{memory}"] if volatile else [])),
        has_side_effects=volatile,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def load_u32x4(address: Int64, *, loc=None, ip=None) -> cute.TensorSSA:
    """One 16-byte global load of 4 words (weights, residual streams, inputs)."""
    return _words_ssa(_load_words(PTX_LOAD_U32X4, 4, address, False, loc, ip), loc=loc, ip=ip)


@dsl_user_op
def load_volatile_u32x4(address: Int64, *, loc=None, ip=None) -> cute.TensorSSA:
    """A 16-byte volatile load for polling a mailbox slot."""
    return _words_ssa(_load_words(PTX_LOAD_VOLATILE_U32X4, 4, address, True, loc, ip), loc=loc, ip=ip)


def _u32_at(text: str, address: Int64, loc, ip) -> Uint32:
    """One 32-bit memory operation at ``address`` that returns a word (a load or an atomic)."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [_value(Int64(address), loc, ip)],
            text,
            "=r,l,~{memory}",
            has_side_effects=True,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def load_volatile_u32(address: Int64, *, loc=None, ip=None) -> Uint32:
    """A volatile 32-bit load (the stage state, written by the previous kernel)."""
    return _u32_at(PTX_LOAD_VOLATILE_U32, address, loc, ip)


@dsl_user_op
def load_volatile_u32x2(address: Int64, *, loc=None, ip=None) -> tuple:
    """A volatile 8-byte load of two words (a stage and the error word beside it: one request)."""
    result = _load_words(PTX_LOAD_VOLATILE_U32X2, 2, address, True, loc, ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), result, [k], loc=loc, ip=ip)) for k in range(2))


# -------------------------------------------------------------------------- stores
def _store(text: str, address: Int64, words: list, loc, ip) -> None:
    """One global store of ``words`` (32-bit values) at ``address``."""
    llvm.inline_asm(
        None,
        [_value(Int64(address), loc, ip), *words],
        text,
        "l," + "r," * len(words) + "~{memory}",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_u32x4(address: Int64, words: cute.TensorSSA, *, loc=None, ip=None) -> None:
    """One 16-byte global store to a 64-bit address (local or a peer's mailbox)."""
    _store(PTX_STORE_U32X4, address, _elements(words, loc=loc, ip=ip), loc, ip)


@dsl_user_op
def multimem_store_bf16x8(address: Int64, words: cute.TensorSSA, *, loc=None, ip=None) -> None:
    """One NVLink multicast store of 8 BF16 values to every rank's copy of a slot."""
    _store(PTX_MULTIMEM_STORE_BF16X8, address, _elements(words, loc=loc, ip=ip), loc, ip)


@dsl_user_op
def arrive_u32(address: Int64, *, loc=None, ip=None) -> Uint32:
    """Add 1 to a 32-bit counter and return its old value, acquire-release at GPU scope (what
    this thread read or wrote before happens before what the one that sees the count does after)."""
    return _u32_at(PTX_ARRIVE_U32, address, loc, ip)


@dsl_user_op
def store_u32(address: Int64, value: Uint32, *, loc=None, ip=None) -> None:
    """A 32-bit global store (the stage state)."""
    _store(PTX_STORE_U32, address, [_value(Uint32(value), loc, ip)], loc, ip)


@dsl_user_op
def store_system_u32(address: Int64, value: Uint32, *, loc=None, ip=None) -> None:
    """A system-scope 32-bit store, visible to the host (the mapped error flag)."""
    _store(PTX_STORE_SYSTEM_U32, address, [_value(Uint32(value), loc, ip)], loc, ip)


@cute.jit
def store_sentinel_u32x4(address: Int64) -> None:
    """Re-arm a slot: 8 BF16 negative zeros."""
    store_u32x4(address, sentinel_u32x4())


# --------------------------------------------------------------- BF16 bit tricks
@cute.jit
def _splat_u32x4(word: cutlass.Constexpr[int]) -> cute.TensorSSA:
    words = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
    words.fill(Uint32(word))
    return words.load()


@cute.jit
def sentinel_u32x4() -> cute.TensorSSA:
    """4 words of BF16 negative zeros (the empty-slot sentinel)."""
    return _splat_u32x4(NEGATIVE_ZERO_BF16_PAIR)


@cute.jit
def _negative_zero_marks(words: cute.TensorSSA, sign: cutlass.Constexpr[int], magnitude: cutlass.Constexpr[int]):
    """Per word, the ``sign`` bits of ``~t`` set iff that value is -0: BF16 halves
    (``sign = 0x80008000``) or FP32 words (``sign = 0x80000000``).

    ``x = w ^ sign`` maps -0 to 0; ``t = ((x & magnitude) + magnitude) | x`` has a value's
    sign bit clear iff that value of ``x`` is 0 (no carry crosses BF16 halves: the sum per
    half is at most 0xFFFE). Checked on all 65536 BF16 patterns in the tests.
    """
    flipped = words ^ Uint32(sign)
    return ((flipped & Uint32(magnitude)) + Uint32(magnitude)) | flipped


@cute.jit
def _any_negative_zero(words: cute.TensorSSA, sign: cutlass.Constexpr[int], magnitude: cutlass.Constexpr[int]):
    # Sign bits of ~t: xor with the sign mask, then keep those bits.
    marks = (_negative_zero_marks(words, sign, magnitude) ^ Uint32(sign)) & Uint32(sign)
    found = marks[0] | marks[1] | marks[2] | marks[3]
    return found != Uint32(0)


@cute.jit
def _sanitize(words: cute.TensorSSA, sign: cutlass.Constexpr[int], magnitude: cutlass.Constexpr[int]):
    return words & (_negative_zero_marks(words, sign, magnitude) | Uint32(magnitude))


@cute.jit
def has_negative_zero(words: cute.TensorSSA) -> Boolean:
    """True if any of the 8 BF16 halves is negative zero (the slot is not yet written)."""
    return _any_negative_zero(words, SIGN_BF16_PAIR, MAGNITUDE_BF16_PAIR)


@cute.jit
def sanitize_negative_zero(words: cute.TensorSSA) -> cute.TensorSSA:
    """Turn every BF16 -0 half into +0 and leave all other bit patterns unchanged."""
    return _sanitize(words, SIGN_BF16_PAIR, MAGNITUDE_BF16_PAIR)


@cute.jit
def nan_u32x4() -> cute.TensorSSA:
    """4 words of BF16 NaNs: what a poisoned kernel uses in place of a fragment."""
    return _splat_u32x4(NAN_BF16_PAIR)


# --------------------------------------------------------------- FP32 bit tricks
@cute.jit
def f32_sentinel_u32x4() -> cute.TensorSSA:
    """4 words of FP32 negative zeros (the empty hand-off slot)."""
    return _splat_u32x4(NEGATIVE_ZERO_F32)


@cute.jit
def has_negative_zero_f32(words: cute.TensorSSA) -> Boolean:
    """True if any of the 4 FP32 words is negative zero."""
    return _any_negative_zero(words, SIGN_F32, MAGNITUDE_F32)


@cute.jit
def sanitize_negative_zero_f32(words: cute.TensorSSA) -> cute.TensorSSA:
    """Turn every FP32 -0 word into +0 and leave all other bit patterns unchanged."""
    return _sanitize(words, SIGN_F32, MAGNITUDE_F32)


# ------------------------------------------------------ reinterpreting 16 bytes
def _reinterpret(values: cute.TensorSSA, count: int, dtype: type, loc, ip) -> cute.TensorSSA:
    """The same 16 bytes as ``count`` values of ``dtype`` (a bit cast, no conversion)."""
    vec = values.ir_value(loc=loc, ip=ip) if hasattr(values, "ir_value") else values
    element = T.i32() if dtype is Uint32 else dtype.mlir_type
    return cute.TensorSSA(vector.bitcast(ir.VectorType.get([count], element), vec, loc=loc, ip=ip), (count,), dtype)


@dsl_user_op
def as_words(values: cute.TensorSSA, *, loc=None, ip=None) -> cute.TensorSSA:
    """Reinterpret 16 bytes of values (8 BF16 or 4 FP32) as 4 packed words."""
    return _reinterpret(values, 4, Uint32, loc, ip)


@dsl_user_op
def words_to_f32x4(words: cute.TensorSSA, *, loc=None, ip=None) -> cute.TensorSSA:
    """Reinterpret 4 words as 4 FP32 values (no conversion)."""
    return _reinterpret(words, 4, Float32, loc, ip)


@dsl_user_op
def words_to_bf16x8(words: cute.TensorSSA, *, loc=None, ip=None) -> cute.TensorSSA:
    """Reinterpret 4 packed words as 8 BF16 values (no conversion)."""
    return _reinterpret(words, VEC_BF16, BFloat16, loc, ip)


@cute.jit
def words_to_f32x8(words: cute.TensorSSA) -> cute.TensorSSA:
    """The 8 BF16 values of a fragment as FP32, exactly (a BF16 is the top half of an FP32)."""
    return words_to_bf16x8(words).to(Float32)


@cute.jit
def f32x8_to_words(values: cute.TensorSSA) -> cute.TensorSSA:
    """Round 8 FP32 values to BF16 (nearest even) and pack them."""
    return as_words(values.to(BFloat16))


@cute.jit
def bf16_bits_to_f32(bits: Uint32) -> Float32:
    """Exact FP32 of one BF16 given as its 16 bits (zero-extended)."""
    return _bits_to_f32(bits << Uint32(16))


@dsl_user_op
def _bits_to_f32(bits: Uint32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), _value(Uint32(bits), loc, ip), loc=loc, ip=ip))


# ------------------------------------------------------------------- arithmetic
def _dot_bf16x8_ptx(mixed: bool) -> str:
    """``$0 = fma(a[k], b[k], $0)`` for k = 0..7 from ``$0 = 0``; operands are 4 + 4 packed words.

    ``mixed``: ``fma.rn.f32.bf16`` on the BF16 halves (sm_100+). Otherwise each half
    is widened exactly (low: ``w << 16``, high: ``w & 0xFFFF0000``) and fed to
    ``fma.rn.f32``: one rounding per step in both, so the results are bit-identical.
    Keeping the unpack inside one asm block stops the compiler from hoisting the
    widened weights out of a token loop (which doubles their registers).
    """
    if mixed:
        text = ["{", ".reg .b16 a<8>, b<8>;"]
        for k in range(4):
            text.append(f"mov.b32 {{a{2 * k}, a{2 * k + 1}}}, ${1 + k};")
            text.append(f"mov.b32 {{b{2 * k}, b{2 * k + 1}}}, ${5 + k};")
        text.append("mov.b32 $0, 0f00000000;")
        text.extend(f"fma.rn.f32.bf16 $0, a{k}, b{k}, $0;" for k in range(VEC_BF16))
    else:
        text = ["{", ".reg .b32 a<8>, b<8>;"]
        for k in range(4):
            text.append(f"shl.b32 a{2 * k}, ${1 + k}, 16;")
            text.append(f"and.b32 a{2 * k + 1}, ${1 + k}, 0xFFFF0000;")
            text.append(f"shl.b32 b{2 * k}, ${5 + k}, 16;")
            text.append(f"and.b32 b{2 * k + 1}, ${5 + k}, 0xFFFF0000;")
        text.append("mov.b32 $0, 0f00000000;")
        text.extend(f"fma.rn.f32 $0, a{k}, b{k}, $0;" for k in range(VEC_BF16))
    text.append("}")
    return "\n\t".join(text)


#: The mixed-precision dot: BF16 operands, FP32 accumulator, exact products (sm_100+).
PTX_DOT_BF16X8 = _dot_bf16x8_ptx(mixed=True)
#: The same dot on sm_90: exact widening, then FP32 FMAs in the same order.
PTX_DOT_BF16X8_WIDENED = _dot_bf16x8_ptx(mixed=False)


@dsl_user_op
def _dot_bf16x8(a: cute.TensorSSA, b: cute.TensorSSA, text: str, *, loc=None, ip=None) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [*_elements(a, loc=loc, ip=ip), *_elements(b, loc=loc, ip=ip)],
            text,
            "=f," + ",".join(["r"] * 8),
            has_side_effects=False,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def dot_bf16x8(a: cute.TensorSSA, b: cute.TensorSSA, mixed_fma: cutlass.Constexpr[bool]) -> Float32:
    """FP32 dot of two packed BF16 fragments: ``acc = fma(a[k], b[k], acc)``, k = 0..7.

    ``mixed_fma`` (sm_100+) uses ``fma.rn.f32.bf16``; otherwise (sm_90, where ptxas
    rejects it) the halves are unpacked exactly and fed to ``fma.rn.f32`` in the
    same order: both round once per step, so the results are bit-identical.
    """
    return _dot_bf16x8(a, b, PTX_DOT_BF16X8 if mixed_fma else PTX_DOT_BF16X8_WIDENED)


#: One warp-wide tensor-core step: ``D[16, 8] = A[16, 16] @ B[16, 8] + C``, BF16 operands,
#: FP32 accumulators (sm_80 on; the same instruction on sm_90 and sm_100).
PTX_MMA_BF16_16816 = (
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)


@dsl_user_op
def mma_bf16_16816(a: list, b: list, c: cute.TensorSSA, *, loc=None, ip=None) -> cute.TensorSSA:
    """``mma.sync`` m16n8k16: ``a`` 4 words, ``b`` 2 words (packed BF16 pairs), ``c`` 4 FP32.

    Lane ``l`` (group ``g = l / 4``, ``k = l % 4``) holds A rows ``g`` / ``g + 8`` at columns
    ``2k, 2k + 1`` (words 0, 1) and ``2k + 8, 2k + 9`` (words 2, 3); B column ``g`` at rows
    ``2k, 2k + 1`` (word 0) and ``2k + 8, 2k + 9`` (word 1); D rows ``g`` (values 0, 1) and
    ``g + 8`` (values 2, 3) at columns ``2k, 2k + 1``. Every lane must execute it.
    """
    operands = [Uint32(w).ir_value(loc=loc, ip=ip) for w in (*a, *b)]
    accumulators = _elements(c, loc=loc, ip=ip)
    result = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        operands + accumulators,
        PTX_MMA_BF16_16816,
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )
    values = [llvm.extractvalue(T.f32(), result, [k], loc=loc, ip=ip) for k in range(4)]
    vec = vector.from_elements(ir.VectorType.get([4], T.f32()), values, loc=loc, ip=ip)
    return cute.TensorSSA(vec, (4,), Float32)


# ------------------------------------------------------------------ shared memory
@dsl_user_op
def load_shared_u32x4(pointer: cute.Pointer, *, loc=None, ip=None) -> cute.TensorSSA:
    """One 16-byte load from shared memory (a staged fragment)."""
    vec = cute.arch.load(pointer.llvm_ptr, ir.VectorType.get([4], T.i32()), loc=loc, ip=ip)
    return cute.TensorSSA(vec, (4,), Uint32)


@dsl_user_op
def store_shared_u32x4(pointer: cute.Pointer, words: cute.TensorSSA, *, loc=None, ip=None) -> None:
    """One 16-byte store to shared memory."""
    cute.arch.store(pointer.llvm_ptr, words.ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


#: Asynchronous global -> shared copies (no registers; completed by ``cp.async.wait_group``):
#: 16 bytes through L2 only (streamed fragments), 4 bytes through L1 (small FP32 rows).
PTX_COPY_ASYNC_16 = "cp.async.cg.shared.global [$0], [$1], 16;"
PTX_COPY_ASYNC_4 = "cp.async.ca.shared.global [$0], [$1], 4;"


def _copy_async(shared: cute.Pointer, address: Int64, text: str, loc, ip) -> None:
    destination = llvm.ptrtoint(T.i32(), shared.llvm_ptr, loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [destination, _value(Int64(address), loc, ip)],
        text,
        "r,l,~{memory}",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def copy_async_16(shared: cute.Pointer, address: Int64, *, loc=None, ip=None) -> None:
    """Start copying 16 bytes from global ``address`` to shared ``shared`` (both 16-byte aligned)."""
    _copy_async(shared, address, PTX_COPY_ASYNC_16, loc, ip)


@dsl_user_op
def copy_async_4(shared: cute.Pointer, address: Int64, *, loc=None, ip=None) -> None:
    """Start copying 4 bytes from global ``address`` to shared ``shared``."""
    _copy_async(shared, address, PTX_COPY_ASYNC_4, loc, ip)


#: A bulk global -> shared copy by the tensor-memory-access engine, completing on an mbarrier
#: (``complete_tx``): it bypasses the load/store unit, so polls issued meanwhile are not queued
#: behind it.
PTX_BULK_COPY = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];"


@dsl_user_op
def bulk_copy(shared: cute.Pointer, address: Int64, size: Int32, barrier: cute.Pointer, *, loc=None, ip=None) -> None:
    """Start copying ``size`` bytes (a multiple of 16; both ends 16-byte aligned) from global
    ``address`` to this CTA's ``shared``; their arrival counts against ``barrier``'s transaction bytes."""
    llvm.inline_asm(
        None,
        [
            llvm.ptrtoint(T.i32(), shared.llvm_ptr, loc=loc, ip=ip),
            _value(Int64(address), loc, ip),
            _value(Int32(size), loc, ip),
            llvm.ptrtoint(T.i32(), barrier.llvm_ptr, loc=loc, ip=ip),
        ],
        PTX_BULK_COPY,
        "r,l,r,r,~{memory}",
        has_side_effects=True,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )


# ----------------------------------------------------------------------- cluster
@cute.jit
def store_to_peer_f32(local: cute.Pointer, peer: Int32, value: Float32) -> None:
    """Store into CTA ``peer``'s copy of shared-memory slot ``local`` (DSMEM)."""
    remote = cute.arch.map_dsmem_ptr(local, peer)
    remote.store(value)


# ------------------------------------------------------------ FP8 quantisation (issue #33)
#: Two FP32 -> two E4M3 (``float8_e4m3fn``) in 16 bits, round to nearest even, magnitudes past 448
#: saturated to +-448, NaN kept NaN (0x7F / 0xFF); the first source goes to the upper byte (sm_89 on).
PTX_CVT_E4M3X2_F32 = "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;"
#: IEEE FP32 division, round to nearest even, no flush to zero (what a bitwise match with a
#: reference's ``x / s`` needs: a reciprocal then a multiply rounds twice).
PTX_DIV_RN_F32 = "div.rn.f32 $0, $1, $2;"
#: The reciprocal ``div.rn.f32``'s fast path starts from (``rcp.approx`` and one Newton step with
#: FMAs), computed once for several quotients by one divisor ...
PTX_RCP_REFINED_F32 = (
    "{ .reg .f32 n, r, e; neg.f32 n, $1; rcp.approx.ftz.f32 r, $1; "
    "fma.rn.f32 e, n, r, 0f3F800000; fma.rn.f32 $0, e, r, r; }"
)
#: ... and each quotient from it: ``q = x * r`` corrected by the exact residual, taken as
#: ``d * q - x`` (an FMA) and multiplied by ``-r``: ``q + (d * q - x) * -r``, the same rounding of
#: the same real number as ``q + (x - d * q) * r``. Three instructions (ptxas folds the negations into
#: the FMAs' operands), and the signed zeros come out right without a select: for ``x = -0``,
#: ``q = -0``, the residual ``d * -0 + 0 = +0``, and ``+0 * -r + -0 = -0``; for ``x = +0`` the
#: same steps give ``+0``.
PTX_DIV_REFINED_F32 = (
    "{ .reg .f32 q, t, nx, nr; mul.rn.f32 q, $1, $3; neg.f32 nx, $1; fma.rn.f32 t, $2, q, nx; "
    "neg.f32 nr, $3; fma.rn.f32 $0, t, nr, q; }"
)
#: Unsigned 16-bit maximum of each half of two words (sm_90 on): BF16 magnitudes compare as integers.
PTX_MAX_U16X2 = "max.u16x2 $0, $1, $2;"
#: An 8-byte global store of 2 words (8 E4M3 values) and a 1-byte one (a UE8M0 scale).
PTX_STORE_U32X2 = "st.global.v2.u32 [$0], {$1, $2};"
PTX_STORE_U8 = "st.global.u8 [$0], $1;"


@dsl_user_op
def cvt_e4m3x2(high: Float32, low: Float32, *, loc=None, ip=None) -> Uint32:
    """``e4m3(high) << 8 | e4m3(low)``, zero-extended to a word (``cvt.rn.satfinite.e4m3x2.f32``)."""
    packed = llvm.inline_asm(
        T.i16(),
        [_value(Float32(high), loc, ip), _value(Float32(low), loc, ip)],
        PTX_CVT_E4M3X2_F32,
        "=h,f,f",
        has_side_effects=False,
        asm_dialect=0,
        loc=loc,
        ip=ip,
    )
    return Uint32(cutlass.Uint16(packed))


@dsl_user_op
def div_rn_f32(numerator: Float32, denominator: Float32, *, loc=None, ip=None) -> Float32:
    """``numerator / denominator``, one IEEE rounding (``div.rn.f32``)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [_value(Float32(numerator), loc, ip), _value(Float32(denominator), loc, ip)],
            PTX_DIV_RN_F32,
            "=f,f,f",
            has_side_effects=False,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def rcp_refined_f32(denominator: Float32, *, loc=None, ip=None) -> Float32:
    """``1 / denominator`` to within the accuracy ``div_refined_f32`` needs (``PTX_RCP_REFINED_F32``);
    ``denominator`` a normal FP32 value."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [_value(Float32(denominator), loc, ip)],
            PTX_RCP_REFINED_F32,
            "=f,f",
            has_side_effects=False,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def div_refined_f32(numerator: Float32, denominator: Float32, reciprocal: Float32, *, loc=None, ip=None) -> Float32:
    """``numerator / denominator`` from ``reciprocal = rcp_refined_f32(denominator)``
    (``PTX_DIV_REFINED_F32``): ``div.rn.f32``'s own fast path, without its per-call range check and
    branch. The caller keeps it to the operands where that path is exact (``mhc_core.device.quant``)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [
                _value(Float32(numerator), loc, ip),
                _value(Float32(denominator), loc, ip),
                _value(Float32(reciprocal), loc, ip),
            ],
            PTX_DIV_REFINED_F32,
            "=f,f,f,f",
            has_side_effects=False,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def max_u16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Per 16-bit half, the unsigned maximum of ``a`` and ``b`` (``max.u16x2``)."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [_value(Uint32(a), loc, ip), _value(Uint32(b), loc, ip)],
            PTX_MAX_U16X2,
            "=r,r,r",
            has_side_effects=False,
            asm_dialect=0,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def store_u32x2(address: Int64, low: Uint32, high: Uint32, *, loc=None, ip=None) -> None:
    """One 8-byte global store of two words (``address`` 8-byte aligned)."""
    _store(PTX_STORE_U32X2, address, [_value(Uint32(low), loc, ip), _value(Uint32(high), loc, ip)], loc, ip)


@dsl_user_op
def store_u8(address: Int64, value: Uint32, *, loc=None, ip=None) -> None:
    """A 1-byte global store of ``value``'s low byte."""
    _store(PTX_STORE_U8, address, [_value(Uint32(value), loc, ip)], loc, ip)


@dsl_user_op
def f32_from_bits(bits: Uint32, *, loc=None, ip=None) -> Float32:
    """The FP32 value whose bits are ``bits`` (a bit cast, no conversion)."""
    return _bits_to_f32(bits, loc=loc, ip=ip)


@dsl_user_op
def f32_to_bits(value: Float32, *, loc=None, ip=None) -> Uint32:
    """The bits of an FP32 value (a bit cast, no conversion)."""
    return Uint32(llvm.bitcast(T.i32(), _value(Float32(value), loc, ip), loc=loc, ip=ip))
