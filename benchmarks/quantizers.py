"""Separate FP8 quantisers of the layer input: what an engine runs after the BF16 op today (``--suite fp8``).

``compiled_quantizer(name)`` is a ``torch.compile``'d quantiser of one ``mhc_core.fp8`` format (inductor,
default mode, static shapes), written so that its ``q`` and scales equal ``mhc_core.fp8.quantize``'s bit
for bit, padding included; the suite checks that on the GPU before it times anything. The roundings
that make it so, step by step (``eager_quantize`` is the same function uncompiled):

* scale ``absmax / 448``: an FP64 quotient rounded to FP32 is the FP32 IEEE quotient (53 >= 2 * 24 + 2
  bits: a double rounding through FP64 is innocuous for a division). Inductor may turn the division by
  the constant into a product with its FP64 reciprocal (2^-52 relative); ``absmax / 448`` is
  ``A / 7 * 2^e`` with ``A`` a 24-bit integer, either exact or at least 2^-27 relative away from any
  FP32 rounding boundary, so the FP32 result is the same;
* ``x / scale`` for FP32 scales: inductor's ``eager_numerics.division_rounding`` makes it Triton's
  ``div_rn`` (IEEE; plain ``/`` is ``div.full.f32``, approximate). On a torch without that option the
  quotient is taken in FP64 and rounded to FP32 (innocuous, as above; slower);
* ``x / scale`` for UE8M0 scales: a product with ``2^-k``, built from its exponent bits (exact;
  a quotient below 2^-126 rounds, and E4M3 takes everything below 2^-10 to a signed zero anyway);
* the clamp to +-448, then ``.to(float8_e4m3fn)`` (round to nearest even, ``cvt.rn.satfinite`` on the
  GPU), as the reference.

``library_quantizers(name)``: vLLM's, SGLang's and FlashInfer's kernels of the same format where they
import (none does on the project's GPU host; each absence is reported with its reason). The suite checks
their values against the reference too and times them either way: the fastest separate step is the
baseline.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mhc_core import fp8

#: ``fp32(1e-10)``, exactly: the absmax and UE8M0 floors as the reference applies them.
FLOOR = torch.tensor(fp8.EPS, dtype=torch.float32).item()
UE8M0_FLOOR = torch.tensor(fp8.UE8M0_FLOOR, dtype=torch.float32).item()
#: The inductor option that makes an FP32 ``/`` IEEE (``triton.language.div_rn``), where torch has it.
DIVISION_ROUNDING = "eager_numerics.division_rounding"
#: Compiled versions dynamo keeps per function: the suite's 3 formats x 2 hidden sizes x 5 M, with room.
RECOMPILES = 64

Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def has_division_rounding() -> bool:
    import torch._inductor.config as inductor

    return hasattr(getattr(inductor, "eager_numerics", None), "division_rounding")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ the quantiser
def eager_quantize(name: str, x: torch.Tensor, *, fp64_division: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 ``[M, H]`` -> ``(q, scales)``: ``q`` E4M3 ``[M, H]``, the scales as one flat tensor of the
    format's whole allocation (``storage_view`` gives them the format's shape and strides).
    ``fp64_division``: the FP32-scale quotient through FP64 (module docstring)."""
    fmt = fp8.get_format(name)
    m, hidden = x.shape
    groups = hidden // fmt.group
    values = x.float().reshape(m, groups, fmt.group)
    absmax = values.abs().amax(dim=-1).clamp_min(FLOOR)
    scale = (absmax.double() / fp8.E4M3_MAX).float()
    if fmt.scale_encoding == "fp32":
        ratio = values / scale[..., None]  # under inductor: div_rn (``compiled_quantizer``)
        if fp64_division:
            ratio = (values.double() / scale.double()[..., None]).float()
        q = ratio.clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn).reshape(m, hidden)
        return q, scale.reshape(-1)
    bits = scale.clamp_min(UE8M0_FLOOR).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # ceil to a power of two
    inverse = ((254 - exponent) << 23).view(torch.float32)  # 2^(127 - exponent): exponent <= 247 for BF16
    ratio = values * inverse[..., None]
    q = ratio.clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn).reshape(m, hidden)
    if fmt.layout == "mn-major-packed":
        return q, _packed_words(exponent, m, groups)
    return q, _swizzled_bytes(exponent, m, groups)


def _packed_words(exponent: torch.Tensor, m: int, groups: int) -> torch.Tensor:
    """DeepGEMM's SM100 SFA: word ``(g / 4) * align(M, 4) + m`` holds group ``g``'s byte at bits
    ``8 (g % 4)``; padding rows and groups 0. Flat int32 of ``P * align(M, 4)`` words."""
    packs, rows = _ceil_div(groups, 4), _ceil_div(m, 4) * 4
    padded = F.pad(exponent.to(torch.int64), (0, 4 * packs - groups, 0, rows - m)).reshape(rows, packs, 4)
    words = padded[..., 0] | (padded[..., 1] << 8) | (padded[..., 2] << 16) | (padded[..., 3] << 24)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed
    return words.t().contiguous().reshape(-1)


def _swizzled_bytes(exponent: torch.Tensor, m: int, groups: int) -> torch.Tensor:
    """The 128x4 swizzle: row ``128 a + 32 b + c`` and group ``4 d + e`` at
    ``((a * D + d) * 32 + c) * 16 + b * 4 + e`` (``D`` = 4-group blocks per row); padding 0."""
    blocks, rows = _ceil_div(groups, 4), _ceil_div(m, 128) * 128
    padded = F.pad(exponent.to(torch.uint8), (0, 4 * blocks - groups, 0, rows - m))
    return padded.reshape(rows // 128, 4, 32, blocks, 4).permute(0, 3, 2, 1, 4).contiguous().reshape(-1)


def storage_view(name: str, scales: torch.Tensor, m: int, hidden: int) -> torch.Tensor:
    """The flat allocation ``eager_quantize`` returns, viewed as ``Fp8Format.empty_scales`` shapes it."""
    fmt = fp8.get_format(name)
    return scales.as_strided(fmt.scale_shape(m, hidden), fmt.scale_strides(m, hidden))


def allow_recompiles(count: int = RECOMPILES) -> None:
    """Let dynamo keep ``count`` compiled versions of one function (its default, 8, would send the
    suite's later shapes to eager torch silently: every format's quantiser shares one code object)."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), count))


def compiled_quantizer(name: str) -> Quantizer:
    """``eager_quantize`` under ``torch.compile`` (default mode, static shapes: one compile per shape,
    fullgraph), its scales viewed as the format's (a view: no kernel)."""
    exact = has_division_rounding()
    options = {DIVISION_ROUNDING: True} if exact else {}
    allow_recompiles()

    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return eager_quantize(name, x, fp64_division=not exact)

    compiled = torch.compile(quantize, dynamic=False, fullgraph=True, options=options)

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, flat = compiled(x)
        return q, storage_view(name, flat, *x.shape)

    return run


# ------------------------------------------------------------------ other libraries'
@dataclass(frozen=True)
class LibraryQuantizer:
    """A third-party kernel of one format: ``call(module, x) -> (q, scales)``."""

    label: str
    module: str
    call: Callable


#: Per format, the per-token-group kernels engines ship (their public Python entry points).
LIBRARY_QUANTIZERS: dict[str, tuple[LibraryQuantizer, ...]] = {
    "fp32-g128": (
        LibraryQuantizer(
            "vLLM per_token_group_quant_fp8",
            "vllm.model_executor.layers.quantization.utils.fp8_utils",
            lambda module, x: module.per_token_group_quant_fp8(x, 128, column_major_scales=False, use_ue8m0=False),
        ),
        LibraryQuantizer(
            "SGLang per_token_group_quant_fp8",
            "sglang.srt.layers.quantization.fp8_kernel",
            lambda module, x: module.per_token_group_quant_fp8(x, 128),
        ),
    ),
    "ue8m0-g128-packed": (
        LibraryQuantizer(
            "vLLM per_token_group_quant_fp8_packed_for_deepgemm",
            "vllm.model_executor.layers.quantization.utils.fp8_utils",
            lambda module, x: module.per_token_group_quant_fp8_packed_for_deepgemm(x, 128, use_ue8m0=True),
        ),
    ),
    "mx-g32": (
        LibraryQuantizer(
            "FlashInfer mxfp8_quantize",
            "flashinfer",
            lambda module, x: module.mxfp8_quantize(x, is_sf_swizzled_layout=True),
        ),
    ),
}


def library_quantizers(name: str) -> tuple[list[tuple[str, Quantizer]], list[str]]:
    """``([(label, quantizer)], [why each other one is absent])`` for one format."""
    found, missing = [], []
    for entry in LIBRARY_QUANTIZERS[name]:
        try:
            module = importlib.import_module(entry.module)
        except Exception as error:  # ImportError, or a library that fails on import without its GPU stack
            missing.append(f"{entry.label}: {entry.module} not importable ({type(error).__name__}: {error})")
            continue
        found.append((entry.label, lambda x, entry=entry, module=module: entry.call(module, x)))
    return found, missing


# ------------------------------------------------------------------ checks
def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s allocation from its first element on."""
    nbytes = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    return tensor.as_strided((nbytes // tensor.element_size(),), (1,)).view(torch.uint8)


def compare(name: str, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, *, whole: bool) -> str | None:
    """None when ``(q, scales)`` equal ``mhc_core.fp8.quantize`` of ``x`` (computed on the CPU: IEEE
    divisions) bit for bit, else what differs. ``whole``: every byte of the scales' allocation (padding
    too; it must be the format's size), else the decoded scale values (a library's padding is its own)."""
    m, hidden = x.shape
    reference_q, reference_scales = fp8.quantize(name, x.cpu())
    codes, expected = q.detach().cpu().reshape(m, hidden).view(torch.uint8), reference_q.view(torch.uint8)
    problems = []
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (m, hidden):
        return f"q is {q.dtype} {tuple(q.shape)}, expected float8_e4m3fn {(m, hidden)}"
    if (codes != expected).any():
        problems.append(f"{int((codes != expected).sum())} of {codes.numel()} q codes")
    try:
        if whole:
            got, want = flat_bytes(scales).cpu(), flat_bytes(reference_scales)  # bytes where they lie
            if got.numel() < want.numel():
                return f"a scale allocation of {got.numel()} bytes, expected {want.numel()}"
            differ = int((got[: want.numel()] != want).sum())
            if differ:
                problems.append(f"{differ} of {want.numel()} scale bytes")
        else:
            got = fp8.unpack_scales(name, scales.cpu(), m, hidden)
            want = fp8.unpack_scales(name, reference_scales, m, hidden)
            differ = int((got.view(torch.int32) != want.view(torch.int32)).sum())
            if differ:
                problems.append(f"{differ} of {want.numel()} scale values")
    except (ValueError, RuntimeError) as error:  # another layout than the format's
        problems.append(f"scales not in the format's layout ({error})")
    return ("differ: " + ", ".join(problems)) if problems else None
