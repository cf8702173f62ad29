"""How the GEMMs that read each FP8 layer-input layout find a scale, and what their product may differ by.

The reads are written from the consumers' public sources, not from ``mhc_core.fp8`` (whose ``unpack_scales``
they check independently), each as a view of the scale tensor's raw bytes:

* ``fp32-g128``, read row-major: vLLM's / SGLang's Triton w8a8 block GEMMs load ``As[m, g]`` through the
  tensor's strides, ``(G, 1)`` as ``per_token_group_quant_fp8(column_major_scales=False)`` makes it; the
  MN-major copy (``mn_major``) is what ``torch._scaled_mm``'s 1x128 scaling demands (strides ``(1, M)``,
  pytorch ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` ``is_blockwise_1x128_scaling``) and what DeepGEMM's
  SM90 GEMM makes of a row-major tensor (``get_mn_major_tma_aligned_tensor``);
* ``ue8m0-g128-packed``: DeepGEMM's SM100 SFA (``csrc/utils/layout.hpp`` ``check_sf_layout``): int32
  ``[M, ceil(K / 512)]``, ``stride(-2) == 1``, ``stride(-1) == align(M, 4)``; four UE8M0 bytes per word
  along K, group ``g`` in byte ``g % 4`` (little-endian) of word ``(m, g / 4)``: the raw bytes as
  ``[P, align(M, 4), 4]`` indexed ``[g / 4, m, g % 4]``;
* ``mx-g32``: the 128x4 swizzle of block-scaled (MX) GEMMs, FlashInfer / TensorRT-LLM
  ``get_sf_out_offset_128x4``: "SF layout [numMTiles, numKTiles, 32 (mTile), 4 (mTile), 4 (kTile)],
  index [mTileIdx, kTileIdx, outerMIdx, innerMIdx, innerKIdx]" with ``outerMIdx = m % 32``,
  ``innerMIdx = (m % 128) / 32``, ``innerKIdx = k % 4``: the raw bytes as ``[ceil(M/128), ceil(G/4), 32,
  4, 4]`` indexed ``[m / 128, g / 4, m % 32, (m % 128) / 32, g % 4]``.

``expected_scales`` computes what each consumer must find from the BF16 layer input, again without
``mhc_core.fp8``: ``absmax / 448`` as an FP64 quotient rounded to FP32 (the FP32 IEEE quotient: 53 >=
2 * 24 + 2 bits make the double rounding innocuous), the UE8M0 power ``2^ceil(log2 s)`` from ``frexp``.

``product_bound``: how far a consumer's GEMM of ``q`` and the scales with a weight ``w`` may lie from
the exact product of the BF16 layer input ``x`` and ``w`` (the weight dequantised: an FP8 weight with
its block scales, exact in FP64). The tests feed non-negative ``x`` and ``w`` (no cancellation, so
every term below is relative to the product itself, and a misread scale shows), per output element:

* quantising the activation: E4M3 keeps 3 fraction bits, so RNE moves a normal value by at most
  ``2^-4`` of itself and a subnormal one by at most half the subnormal step, ``2^-10`` of the scale;
  the FP32 quotient ``x / s`` before it adds ``2^-24``: ``|x_hat - x| <= 2^-4 (1 + 2^-19) x + 2^-10 s``,
  summed against ``w``;
* accumulating (``accumulation`` x the sum of ``x_hat w``): in FP64 (the emulated consumers) ``2^-40``,
  generous for ``K <= 2^12`` terms; on Hopper's FP8 tensor cores ``HOPPER_FP8_ACCUMULATION``: the MMA
  keeps about 14 bits when it adds a k-slice's products into its accumulator (DeepSeek-V3 technical
  report, section 3.3.2, measured on H800), so each of a 128-group's 128 products and 4 accumulator
  additions loses at most ``2^-13`` of the group's partial sum, which non-negative data bounds by the
  group's sum: ``132 * 2^-13``; cuBLAS then scales and adds the groups in FP32 (``(G + 2) 2^-24``);
* the output's rounding: ``2^-9`` of the value for BF16 (RNE, 8 significant bits), ``2^-24`` for FP32.
"""

from __future__ import annotations

import functools

import torch

E4M3_MAX = 448.0
#: ``fp32(1e-10)``: vLLM's absmax floor and its UE8M0 scale floor.
FLOOR = torch.tensor(1e-10, dtype=torch.float32).item()
FP64_ACCUMULATION = 2.0**-40
BF16_OUTPUT, FP32_OUTPUT = 2.0**-9, 2.0**-24
FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
GROUP = {"fp32-g128": 128, "ue8m0-g128-packed": 128, "mx-g32": 32}


def hopper_fp8_accumulation(groups: int) -> float:
    """The accumulation term of a Hopper block-scaled FP8 GEMM over ``groups`` K-groups (module docstring)."""
    return 132 * 2.0**-13 + (groups + 2) * 2.0**-24


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ raw bytes
def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s allocation from its first element on, where they lie."""
    nbytes = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    return tensor.as_strided((nbytes // tensor.element_size(),), (1,)).view(torch.uint8)


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """FP64 ``2^exponent`` from its bits (exact; ``torch.ldexp`` goes through a ``pow``)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def ue8m0_value(codes: torch.Tensor) -> torch.Tensor:
    """FP32 ``2^(code - 127)`` of UE8M0 bytes (0 is ``2^-127``, subnormal; 255, NaN, is never expected)."""
    return power_of_two(codes.to(torch.int64) - 127).float()


# ------------------------------------------------------------------ the consumers' reads
def read_row_major(scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    """vLLM / SGLang Triton w8a8: FP32 ``As[m, g]`` at float ``m * G + g``."""
    groups = hidden // 128
    assert scales.dtype == torch.float32 and tuple(scales.stride()) == (groups, 1), "row-major FP32 [M, G]"
    return raw_bytes(scales)[: 4 * m * groups].view(torch.float32).reshape(m, groups).clone()


def mn_major(rows: torch.Tensor) -> torch.Tensor:
    """``[M, G]`` with strides ``(1, M)``: ``torch._scaled_mm``'s BlockWise1x128 operand."""
    return rows.t().contiguous().t()


def _deepgemm_view(scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    groups = hidden // 128
    packs, rows = ceil_div(groups, 4), ceil_div(m, 4) * 4
    assert scales.dtype == torch.int32 and tuple(scales.shape) == (m, packs), "DeepGEMM SFA: int32 [M, ceil(K/512)]"
    assert m == 1 or scales.stride(-2) == 1, "DeepGEMM SFA: MN-major"
    assert packs == 1 or scales.stride(-1) == rows, "DeepGEMM SFA: stride(-1) == align(M, 4)"
    return raw_bytes(scales)[: 4 * packs * rows].reshape(packs, rows, 4)


def _swizzled_view(scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    groups = hidden // 32
    tiles, blocks = ceil_div(m, 128), ceil_div(groups, 4)
    assert scales.dtype == torch.uint8 and scales.numel() == tiles * blocks * 512, "128x4: align(M,128)*align(G,4)"
    return raw_bytes(scales)[: tiles * blocks * 512].reshape(tiles, blocks, 32, 4, 4)


def _deepgemm_index(m: int, groups: int, device) -> tuple[torch.Tensor, ...]:
    row = torch.arange(m, device=device)[:, None].expand(m, groups)
    group = torch.arange(groups, device=device)[None, :].expand(m, groups)
    return group // 4, row, group % 4


def _swizzled_index(m: int, groups: int, device) -> tuple[torch.Tensor, ...]:
    row = torch.arange(m, device=device)[:, None].expand(m, groups)
    group = torch.arange(groups, device=device)[None, :].expand(m, groups)
    return row // 128, group // 4, row % 32, (row % 128) // 32, group % 4


def read_deepgemm_packed(scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    """DeepGEMM SM100 SFA: FP32 ``[M, G]`` values of the packed UE8M0 bytes."""
    view = _deepgemm_view(scales, m, hidden)
    return ue8m0_value(view[_deepgemm_index(m, hidden // 128, view.device)])


def read_swizzled(scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    """MX block-scaled GEMMs (cuBLASLt VEC32_UE8M0, CUTLASS SM100): FP32 ``[M, G]`` values."""
    view = _swizzled_view(scales, m, hidden)
    return ue8m0_value(view[_swizzled_index(m, hidden // 32, view.device)])


READS = {"fp32-g128": read_row_major, "ue8m0-g128-packed": read_deepgemm_packed, "mx-g32": read_swizzled}


def padding(name: str, scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    """The bytes of the layout no (row < M, group < G) reads: what a consumer's tile loads past them."""
    if name == "fp32-g128":  # exactly [M, G] floats: nothing past them
        return torch.empty(0, dtype=torch.uint8, device=scales.device)
    if name == "ue8m0-g128-packed":
        view, index = _deepgemm_view(scales, m, hidden), _deepgemm_index(m, hidden // 128, scales.device)
    else:
        view, index = _swizzled_view(scales, m, hidden), _swizzled_index(m, hidden // 32, scales.device)
    unread = torch.ones_like(view, dtype=torch.bool)
    unread[index] = False
    return view[unread]


# ------------------------------------------------------------------ expectations
def expected_scales(name: str, layer_input: torch.Tensor) -> torch.Tensor:
    """FP32 ``[M, G]``: the scale each group of the BF16 layer input must carry (module docstring)."""
    m, hidden = layer_input.shape
    group = GROUP[name]
    absmax = layer_input.float().abs().reshape(m, hidden // group, group).amax(dim=-1).clamp_min(FLOOR)
    scale = (absmax.double() / E4M3_MAX).float()
    if name == "fp32-g128":
        return scale
    mantissa, exponent = torch.frexp(scale.clamp_min(FLOOR).double())  # scale = mantissa 2^exponent
    power = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(scale))
    return power_of_two(power).float()


def dequantized(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """FP64 ``q * scale`` (exact) of ``q`` ``[M, H]`` and per-group scales ``[M, G]``."""
    return q.float().double() * rows.double().repeat_interleave(q.shape[1] // rows.shape[1], dim=1)


def product_bound(
    layer_input: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, *, accumulation: float, output: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ weight.T exactly (FP64), the bound on a consumer's |y - that|)`` for non-negative ``x``
    (BF16 ``[M, K]``) with scales ``rows`` and a non-negative FP64 weight ``[N, K]`` (module docstring)."""
    x = layer_input.double()
    assert bool((x >= 0).all()) and bool((weight >= 0).all()), "the bound is for non-negative data"
    exact = x @ weight.t()
    spread = rows.double().repeat_interleave(x.shape[1] // rows.shape[1], dim=1) @ weight.t()
    quantization = 2.0**-4 * (1 + 2.0**-19) * exact + 2.0**-10 * spread
    summed = accumulation * (exact + quantization)
    rounded = output * (exact + quantization + summed)
    return exact, quantization + summed + rounded + FP64_ACCUMULATION * exact


def assert_within_bound(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> float:
    """``|actual - exact| <= bound`` everywhere; the largest ``|actual - exact| / bound`` (for the log)."""
    error = (actual.double() - exact).abs()
    assert bool(torch.isfinite(actual).all()), f"{what}: non-finite product"
    excess = error > bound
    if bool(excess.any()):
        index = tuple(excess.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(excess.sum())} of {error.numel()} products outside the bound; first {index}: "
            f"{actual[index].item()!r} vs exact {exact[index].item()!r}, bound {bound[index].item()!r}"
        )
    return float((error / bound.clamp_min(1e-300)).max())


# ------------------------------------------------------------------ weights
def block_quantized_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A BF16 weight ``[N, K]`` as DeepSeek-style FP8 with one FP32 scale per 128 x 128 block:
    ``(q [N, K], scales [N/128, K/128] contiguous, the dequantised weight in FP64)``."""
    n, k = weight.shape
    blocks = weight.float().reshape(n // 128, 128, k // 128, 128)
    absmax = blocks.abs().amax(dim=(1, 3)).clamp_min(FLOOR)
    scales = (absmax.double() / E4M3_MAX).float()
    q = (blocks / scales[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(n, k)
    full = scales.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return q, scales, q.float().double() * full


def mx_quantized_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A BF16 weight ``[N, K]`` as MXFP8 (UE8M0 per 1 x 32 along K, the 128x4 swizzle over its N rows):
    ``(q, scale bytes, the dequantised weight in FP64)``."""
    n, k = weight.shape
    groups = k // 32
    power = expected_scales("mx-g32", weight)
    q = (weight.float().reshape(n, groups, 32) / power[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).reshape(n, k)
    codes = (torch.frexp(power.double())[1] + 126).to(torch.uint8)  # 2^e = 0.5 * 2^(e+1): byte e + 127
    scales = torch.zeros(ceil_div(n, 128) * ceil_div(groups, 4) * 512, dtype=torch.uint8, device=weight.device)
    view = scales.reshape(ceil_div(n, 128), ceil_div(groups, 4), 32, 4, 4)
    view[_swizzled_index(n, groups, weight.device)] = codes
    return q, scales, dequantized(q, power)


# ------------------------------------------------------------------ the real consumers
@functools.cache
def scaled_mm_problem(recipe: str) -> str | None:
    """Why this host's torch cannot run a block-scaled FP8 matmul with ``recipe`` (``"1x128"``: 1 x 128
    activation scales against 128 x 128 weight blocks, FP32; ``"mx"``: MXFP8, UE8M0 per 32 in the
    128x4 swizzle), or None when a small one runs."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    capability = "sm_{}{}".format(*torch.cuda.get_device_capability())
    if recipe == "mx" and torch.cuda.get_device_capability()[0] < 10:  # not even tried: cuBLASLt has none
        return f"MXFP8 (cuBLASLt VEC32_UE8M0) needs sm_100 or later, this GPU is {capability}"
    m, n, k = (16, 256, 256) if recipe == "1x128" else (256, 256, 256)  # the GPU test's smallest M
    a = torch.zeros(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.zeros(n, k, device="cuda").to(torch.float8_e4m3fn)
    try:
        if recipe == "1x128":
            scale_a = mn_major(torch.ones(m, k // 128, device="cuda"))
            scale_b = torch.ones(n // 128, k // 128, device="cuda").t()
            torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        else:
            if not hasattr(torch, "float8_e8m0fnu"):
                return f"torch {torch.__version__} has no float8_e8m0fnu"
            ones = torch.full((m * k // 32,), 127, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
            torch._scaled_mm(a, b.t(), scale_a=ones, scale_b=ones.clone(), out_dtype=torch.bfloat16)  # m == n
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        return f"torch {torch.__version__} on {capability}: {type(error).__name__}: {str(error).splitlines()[0]}"
    return None
