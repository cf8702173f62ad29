"""FP8 layer-input formats (issue #33): what each consumer GEMM reads, and torch references.

The ops can write the layer input (the RMSNorm output, BF16 ``[M, H]``) as FP8 E4M3 with
per-group scales, in the layout the next GEMM reads. Three formats, one scale rule per
encoding; each is a :class:`Fp8Format` (data) with shape helpers, and :func:`quantize`
/ :func:`dequantize` are the references a kernel must match bit for bit. ``docs/fp8-layouts.md``
has worked index examples and the open questions.

Rounding (what a kernel computes, step by step; every step FP32, round to nearest even)
-----------------------------------------------------------------------------------------
Per group ``g`` of ``group`` consecutive elements of a row:

1. ``a = max(max_i |fp32(x_i)|, EPS)``, ``EPS = fp32(1e-10)``: exact (a maximum of BF16 values
   widened exactly), floored as vLLM's kernel does (it starts the reduction at ``eps``).
2. ``s = a / 448``: one IEEE division (``div.rn.f32``, not ``rcp`` then multiply).
3. The scale. FP32 encoding: ``scale = s``. UE8M0 encoding: ``scale = 2^ceil(log2(max(s, 1e-10)))``,
   the smallest power of two ``>= max(s, fp32(1e-10))``, stored as its biased exponent byte
   ``e = 127 + log2(scale)``. It is computed exactly from the bits of ``s``: the exponent field,
   plus one if any mantissa bit is set. vLLM's kernel writes ``exp2f(ceilf(log2f(fmaxf(s, 1e-10f))))``;
   the two agree for every BF16 input (the tests prove it over all BF16 values: ``s`` is either an
   exact power of two or at least ``2^-8`` relatively above one, far beyond ``log2f``'s error).
4. ``q_i = e4m3(clamp(fp32(x_i) / scale, -448, 448))``: one IEEE division, the clamp, then one
   round to nearest even into E4M3 (``cvt.rn.satfinite.e4m3x2.f32`` on the device; torch's
   ``.to(torch.float8_e4m3fn)`` here, which rounds to nearest even: the tests check it against an
   independent table of E4M3's codes). The explicit clamp makes whatever the cast does past 448
   irrelevant (torch 2.13 saturates). For a UE8M0 scale the division is exact (a power of two;
   only quotients below ``2^-126`` round, and E4M3 takes those to 0 anyway), so ``q`` is rounded
   once; for an FP32 scale it is rounded twice (FP32, then E4M3), as the kernel rounds.

Consequences the tests pin down: ``-0`` stays ``-0`` (code ``0x80``), and so does a negative value
that rounds to zero; an all-zero group has FP32 scale ``fp32(1e-10) / 448`` and UE8M0 scale
``2^-33`` (byte 94; see ``UE8M0_FLOOR``) with every ``q`` zero; the group's absmax element is
``+-448`` exactly under an FP32 scale (``a / s`` is within one FP32 ulp of 448: clamped, then
exact) and is in ``[224, 448]`` under a UE8M0 scale; nothing saturates otherwise and no NaN is
produced from finite input. Non-finite input is refused (the kernels' ``fmaxf`` and torch's
``amax`` treat NaN differently; a layer input is finite).

Checked on an H200 (docs/fp8-layouts.md): a CUDA kernel doing steps 1-4 with ``fmaxf``, ``/``,
``log2f``/``ceilf``/``exp2f`` and ``cvt.rn.satfinite.e4m3x2.f32`` matches :func:`quantize` bit for bit
in all three formats, and :func:`quantize` on CUDA tensors matches it on the CPU.

Dequantisation (:func:`dequantize`): ``x_hat = fp32(q) * scale``, one FP32 product. Error bound
(derived in the tests): ``|x_hat - x| <= 2^-4 |x| + 2^-10 scale`` (E4M3 has 3 mantissa bits, so
RNE is within ``2^-4`` relatively on normals, ``|y| >= 2^-6``, and within half its subnormal step,
``2^-10``, below), plus FP32 roundings of order ``2^-23``. One exception, far from any layer
input: under a UE8M0 scale an element of magnitude ``>= 1.9375 * 2^127`` (BF16's top values) has
scale ``2^120`` and ``q = +-256``, whose product ``2^128`` overflows FP32 (inf); the codes are finite.

The formats
-----------
``fp32-g128`` (:data:`FP32_G128`): group 128, FP32 scales, row-major ``[M, H/128]``, strides
  ``(H/128, 1)``: scale of (row m, group g) at float index ``m * H/128 + g``. The semantics of vLLM's
  ``per_token_group_quant_fp8(x, 128, column_major_scales=False, use_ue8m0=False)``; read by the
  Triton w8a8 block-FP8 GEMMs of vLLM / SGLang (``w8a8_triton_block_scaled_mm``,
  ``w8a8_block_fp8_matmul_triton``). DeepGEMM's SM90 FP8 GEMM and vLLM's CUTLASS block-FP8 path read
  the same FP32 values MN-major (``column_major_scales=True``; DeepGEMM transposes a row-major
  tensor itself, ``get_mn_major_tma_aligned_tensor``): a transposed copy of this tensor.

``ue8m0-g128-packed`` (:data:`UE8M0_G128_PACKED`): group 128, UE8M0 scales, four per int32 along K,
  MN-major and TMA-aligned, as DeepGEMM's SM100 FP8 GEMMs (``fp8_gemm_nt`` with the ``(1, 1, 128)``
  recipe; ``sm100_fp8_fp4_gemm_1d1d``) read SFA. With ``G = H/128``, ``P = ceil(G/4)`` and
  ``Ma = align(M, 4)`` (16-byte TMA alignment of the MN dimension: ``get_tma_aligned_size(M, 4)``):
  an int32 tensor of shape ``[M, P]``, strides ``(1, Ma)``, over an allocation of ``P * Ma`` words.
  Word ``(m, p)`` is at word index ``p * Ma + m``; its byte ``b`` (bits ``8b .. 8b+7``, little-endian
  memory: byte offset ``4 (p * Ma + m) + b``) is the exponent byte of group ``4p + b``. Bytes of
  groups ``>= G`` and words of rows ``M .. Ma-1`` are 0 here (DeepGEMM's packer writes 0 for
  missing groups; its rows past M are never read). Equals vLLM's
  ``per_token_group_quant_fp8_packed_for_deepgemm`` / DeepGEMM's
  ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` of the same scales.

``mx-g32`` (:data:`MX_G32`): group 32, UE8M0 scales in the swizzled 128x4 layout of block-scaled
  (MX) GEMMs: cuBLASLt's ``VEC32_UE8M0`` scale mode and CUTLASS's SM100 ``mxf8f6f4`` kernels
  (``Sm1xxBlockScaledConfig``), as FlashInfer's ``mxfp8_quantize(is_sf_swizzled_layout=True)`` and
  torchao's ``to_blocked`` lay them out. With ``G = H/32``, ``CB = ceil(G/4)`` and
  ``Mp = align(M, 128)``: a flat uint8 tensor of ``Mp * 4 CB`` bytes; the scale of (row m, group g)
  is at ``((m // 128) * CB + g // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + g % 4``.
  Every padding byte (rows ``M .. Mp-1``, groups ``G .. 4 CB - 1``) is 0, as FlashInfer writes it.
  Any M (no minimum). View it as ``torch.float8_e8m0fnu`` for ``torch._scaled_mm``.

Sources read (public code; nothing here is copied from them)
-------------------------------------------------------------
* vllm-project/vllm ``vllm/model_executor/layers/quantization/utils/fp8_utils.py``:
  ``per_token_group_quant_fp8`` (``eps=1e-10``, fp8 max from ``torch.finfo`` = 448, scale layouts),
  ``per_token_group_quant_fp8_packed_for_deepgemm`` (packed shape ``[mn, ceil(G/4)]``, strides
  ``(1, align(mn, 4))``), the Triton ``_per_token_group_quant_fp8`` (``y / y_s``, clamp, cast).
* vllm-project/vllm ``csrc/quantization/w8a8/fp8/per_token_group_quant.cu``:
  ``per_token_group_quant_8bit_kernel`` (absmax from ``eps``, ``y_s = absmax / max``, UE8M0 as
  ``exp2f(ceilf(log2f(fmaxf(y_s, 1e-10f))))``, ``q = clamp(x / y_s)``) and
  ``per_token_group_quant_8bit_packed_kernel`` (exponent byte ``pos = g % 4`` OR-ed into word
  ``(g / 4) * tma_aligned_mn + m`` of a zeroed buffer).
* deepseek-ai/DeepGEMM ``csrc/apis/layout.hpp`` ``transform_sf_into_required_layout``;
  ``csrc/utils/math.hpp`` ``get_tma_aligned_size`` (16 bytes / element size);
  ``csrc/utils/layout.hpp`` ``check_sf_layout`` (int SFA: ``size(-1) == ceil(K / 512)``,
  ``stride(-1) == get_tma_aligned_size(mn, 4)``, ``stride(-2) == 1``);
  ``csrc/jit_kernels/impls/smxx_layout.hpp`` ``get_mn_major_tma_aligned_packed_ue8m0_tensor``(``_torch``);
  ``deep_gemm/include/deep_gemm/impls/smxx_layout.cuh`` ``transpose_and_pack_fp32_into_ue8m0``
  (``v0 >> 23 | v1 >> 15 | v2 >> 7 | v3 << 1``; zero sign and mantissa asserted);
  ``deep_gemm/utils/math.py`` ``ceil_to_ue8m0``, ``per_token_cast_to_fp8`` (its test quantiser:
  ``clamp(1e-4)``, multiply by ``1 / sf``).
* NVIDIA/cutlass ``include/cutlass/detail/sm100_blockscaled_layout.hpp``: ``SfKMajorAtom`` =
  ``((32, 4), (SFVec, 4)) : ((16, 4), (0, 1))``, ``tile_atom_to_shape_SFA`` (K tiles inner).
* flashinfer-ai/flashinfer ``csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh``:
  ``get_sf_out_offset_128x4``, ``cvt_warp_fp16_to_mxfp8``; ``.../kernels/quantization.cuh``
  ``quantize_with_block_size`` (padding scale bytes 0); ``flashinfer/quantization/fp8_quantization.py``
  ``mxfp8_quantize``.
* pytorch/ao ``torchao/prototype/mx_formats/utils.py`` ``to_blocked`` / ``from_blocked``;
  ``torchao/prototype/mx_formats/mx_tensor.py`` ``_to_mx_rceil`` (RCEIL: ceil of ``amax / 448``).
"""

from __future__ import annotations

import sys

import torch

# The formats themselves: a torch-free table (``mhc_core.fp8_formats``), which the model configs and codegen read.
from .fp8_formats import (
    FORMATS,
    FP32_G128,
    MX_G32,
    UE8M0_G128_PACKED,
    Fp8Format,
    ScaleEncoding,
    ScaleLayout,
    _align,
    _ceil_div,
    get_format,
)

#: Largest finite E4M3 (``float8_e4m3fn``) magnitude.
E4M3_MAX = 448.0
#: The group absmax floor (vLLM's ``per_token_group_quant_fp8`` default ``eps``), applied in FP32.
EPS = 1e-10
#: The UE8M0 scale floor before the power-of-two ceiling (vLLM's kernel: ``fmaxf(y_s, 1e-10f)``):
#: a group with absmax below ``448 * 1e-10`` gets scale ``2^-33``.
UE8M0_FLOOR = 1e-10
#: UE8M0 exponent bias: byte ``e`` means ``2^(e - 127)``; 0 is ``2^-127``, 255 is NaN.
UE8M0_BIAS = 127
#: What every padding byte of a padded scale layout holds.
SCALE_PADDING_BYTE = 0

__all__ = [
    "E4M3_MAX", "EPS", "FORMATS", "FP32_G128", "MX_G32", "SCALE_PADDING_BYTE", "UE8M0_BIAS", "UE8M0_FLOOR",
    "UE8M0_G128_PACKED", "Fp8Format", "ScaleEncoding", "ScaleLayout", "dequantize", "get_format", "group_absmax",
    "group_scales", "pack_scales", "quantize", "unpack_scales",
]  # fmt: skip


def _format(fmt: Fp8Format | str) -> Fp8Format:
    return fmt if isinstance(fmt, Fp8Format) else get_format(fmt)


# ---------------------------------------------------------------- scale arithmetic
def group_absmax(x: torch.Tensor, group: int) -> torch.Tensor:
    """``max(max |fp32(x)| over each group, fp32(EPS))``, FP32 ``[M, H / group]``."""
    m, hidden = x.shape
    absmax = x.float().abs().reshape(m, hidden // group, group).amax(dim=-1)
    return torch.clamp(absmax, min=torch.tensor(EPS, dtype=torch.float32).item())


def fp32_scales(absmax: torch.Tensor) -> torch.Tensor:
    """``absmax / 448``: one FP32 IEEE division (never a reciprocal multiply).

    The divisor is a full tensor: on CUDA, torch divides by a scalar (a Python number or a CPU
    0-dim tensor) as a multiply by its reciprocal, which rounds differently.
    """
    return absmax / torch.full_like(absmax, E4M3_MAX)


def ue8m0_exponents(scales: torch.Tensor) -> torch.Tensor:
    """Biased exponent bytes (uint8) of the smallest powers of two ``>= max(scales, fp32(UE8M0_FLOOR))``.

    Exact: the FP32 exponent field, plus one where any mantissa bit is set. ``scales`` must be
    positive and finite; the floor keeps them normal, so the result lies in ``[94, 254]``.
    """
    floored = torch.clamp(scales.float(), min=torch.tensor(UE8M0_FLOOR, dtype=torch.float32).item())
    if not bool(torch.isfinite(floored).all()):
        raise ValueError("UE8M0 scales of non-finite values")
    bits = floored.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exponent.to(torch.uint8)


def ue8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """FP32 ``2^(code - 127)`` of UE8M0 bytes: 0 is ``2^-127`` (an FP32 subnormal), 255 is NaN."""
    exponent = codes.to(torch.int32)
    value = (exponent << 23).view(torch.float32)
    value = torch.where(exponent == 0, torch.tensor(2.0**-127, dtype=torch.float32), value)
    return torch.where(exponent == 255, torch.tensor(float("nan"), dtype=torch.float32), value)


def to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(values, -448, 448))``: round to nearest even, -0 kept (code 0x80)."""
    return torch.clamp(values.float(), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def group_scales(fmt: Fp8Format | str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scales of ``x`` (BF16 ``[M, H]``) before any layout: ``(fp32 [M, G], codes [M, G])``.

    ``codes`` are the FP32 scales themselves for the FP32 encoding and the UE8M0 exponent bytes for
    the UE8M0 one (the FP32 tensor then holds their values, ``2^(code - 127)``).
    """
    fmt = _format(fmt)
    _check_input(fmt, x)
    scales = fp32_scales(group_absmax(x, fmt.group))
    if fmt.scale_encoding == "fp32":
        return scales, scales
    codes = ue8m0_exponents(scales)
    return ue8m0_to_float(codes), codes


# ---------------------------------------------------------------- layouts
def pack_scales(fmt: Fp8Format | str, codes: torch.Tensor, hidden: int) -> torch.Tensor:
    """Lay per-group scale codes (``[M, G]``: FP32 scales or UE8M0 bytes) out as ``fmt`` stores them."""
    fmt = _format(fmt)
    m, g = codes.shape
    if g != fmt.groups(hidden):
        raise ValueError(f"{fmt.name}: {g} scales per row for hidden {hidden}, expected {fmt.groups(hidden)}")
    out = fmt.empty_scales(m, hidden, device=codes.device)
    if fmt.layout == "row-major":
        out.copy_(codes.float())
        return out
    codes = codes.to(torch.uint8)
    if fmt.layout == "mn-major-packed":
        if sys.byteorder != "little":  # the device reads the int32 words little-endian
            raise RuntimeError("packing UE8M0 words needs a little-endian host")
        rows, packs = _align(m, 4), _ceil_div(g, 4)
        padded = torch.full((rows, packs * 4), SCALE_PADDING_BYTE, dtype=torch.uint8, device=codes.device)
        padded[:m, :g] = codes
        # [Ma, P, 4] bytes -> word (p, m) at p * Ma + m, byte b = group 4p + b.
        words = padded.reshape(rows, packs, 4).permute(1, 0, 2).contiguous().view(torch.int32)
        out.as_strided((rows * packs,), (1,)).copy_(words.reshape(-1))
        return out
    rows, cols = _align(m, 128), _align(g, 4)
    padded = torch.full((rows, cols), SCALE_PADDING_BYTE, dtype=torch.uint8, device=codes.device)
    padded[:m, :g] = codes
    # row = 128 rb + 32 i + j, group = 4 cb + c  ->  ((rb * CB + cb) * 32 + j) * 16 + i * 4 + c
    tiles = padded.reshape(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4)
    out.copy_(tiles.reshape(-1))
    return out


def unpack_scales(fmt: Fp8Format | str, scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    """The inverse of :func:`pack_scales` followed by decoding: FP32 scales ``[M, G]``."""
    fmt = _format(fmt)
    g = fmt.groups(hidden)
    if tuple(scales.shape) != fmt.scale_shape(m, hidden) or scales.dtype != fmt.scale_dtype:
        raise ValueError(
            f"{fmt.name}: scales {tuple(scales.shape)} {scales.dtype}, expected "
            f"{fmt.scale_shape(m, hidden)} {fmt.scale_dtype}"
        )
    if fmt.layout == "row-major":
        return scales.float().clone()
    if fmt.layout == "mn-major-packed":
        words = scales.to(torch.int64) & 0xFFFFFFFF  # [M, P], read through the strides
        shifts = torch.arange(4, device=scales.device, dtype=torch.int64) * 8
        codes = ((words[:, :, None] >> shifts) & 0xFF).reshape(m, 4 * scales.shape[1])[:, :g]
        return ue8m0_to_float(codes)
    rows, cols = _align(m, 128), _align(g, 4)
    tiles = scales.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    codes = tiles.reshape(rows, cols)[:m, :g]
    return ue8m0_to_float(codes)


# ---------------------------------------------------------------- the references
def _check_input(fmt: Fp8Format, x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{fmt.name}: the layer input is BF16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{fmt.name}: expected [M, H], got shape {tuple(x.shape)}")
    fmt.groups(x.shape[1])
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{fmt.name}: non-finite layer input")


def quantize(fmt: Fp8Format | str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 ``[M, H]`` -> ``(q float8_e4m3fn [M, H], scales in fmt's layout)``, rounded as a kernel rounds.

    ``q = e4m3(clamp(fp32(x) / scale, -448, 448))`` per group (module docstring, steps 1-4).
    """
    fmt = _format(fmt)
    scale, codes = group_scales(fmt, x)
    m, hidden = x.shape
    ratio = x.float().reshape(m, fmt.groups(hidden), fmt.group) / scale[:, :, None]
    q = to_e4m3(ratio).reshape(m, hidden)
    return q, pack_scales(fmt, codes, hidden)


def dequantize(fmt: Fp8Format | str, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``fp32(q) * scale`` broadcast over each group (one FP32 product): FP32 ``[M, H]``."""
    fmt = _format(fmt)
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(f"{fmt.name}: q must be float8_e4m3fn [M, H], got {q.dtype} {tuple(q.shape)}")
    m, hidden = q.shape
    scale = unpack_scales(fmt, scales, m, hidden)
    return (q.float().reshape(m, fmt.groups(hidden), fmt.group) * scale[:, :, None]).reshape(m, hidden)
