"""The FP8 layer-input references of issue #33 (``mhc_core.fp8``), on the CPU.

* The layouts are checked byte for byte against slow re-implementations written index by index
  from the documented formulas (``docs/fp8-layouts.md``), padding included.
* The rounding is checked against independent arithmetic: E4M3 against a table of its 127
  non-negative codes (nearest, ties to the even code), the UE8M0 exponent against ``math.frexp``
  over every BF16 value, the FP32 scale against numpy's FP32 division.
* The round trip against an error bound derived below.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from mhc_core import fp8

HIDDENS = (4096, 5120, 4608, 7168)  # GLM-5.3, DSV4.1, and two more that 32 and 128 divide
ROWS = (1, 3, 129, 300)
FORMATS = tuple(fp8.FORMATS.values())
BF16_MAX = torch.finfo(torch.bfloat16).max


def _layer_input(m: int, hidden: int, seed: int, huge: float = BF16_MAX) -> torch.Tensor:
    """BF16 rows whose groups span magnitudes 2^-24 .. 2^24, with zero, -0, tiny and huge groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    x = x * torch.exp2(torch.randint(-24, 25, (m, hidden // 32), generator=g).float()).repeat_interleave(32, 1)
    x = x.to(torch.bfloat16)
    x[0, :128] = 0.0  # all-zero group in every format
    if m > 1:
        x[1, :128] = -0.0
        x[1, 128:256] = huge  # saturating magnitudes
        x[1, 130] = -huge
    if m > 2:
        x[2, :128] = (torch.randn(128, generator=g) * 1e-9).to(torch.bfloat16)  # under the UE8M0 floor
    return x


def _storage_bytes(scales: torch.Tensor) -> bytes:
    assert scales.storage_offset() == 0
    return bytes(scales.untyped_storage())


# ----------------------------------------------------------------- format table and shapes
def test_format_table() -> None:
    assert sorted(fp8.FORMATS) == ["fp32-g128", "mx-g32", "ue8m0-g128-packed"]
    assert fp8.get_format("mx-g32") is fp8.MX_G32
    with pytest.raises(ValueError, match="unknown FP8"):
        fp8.get_format("fp8")
    assert [(f.group, f.scale_encoding, f.scale_dtype) for f in FORMATS] == [
        (128, "fp32", torch.float32),
        (128, "ue8m0", torch.int32),
        (32, "ue8m0", torch.uint8),
    ]
    with pytest.raises(ValueError, match="multiple of the group"):
        fp8.FP32_G128.groups(4096 + 32)


@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("m", (0, *ROWS))
def test_scale_shapes_and_strides(m: int, hidden: int) -> None:
    g128, g32 = hidden // 128, hidden // 32
    m4, m128 = -(-m // 4) * 4, -(-m // 128) * 128
    packs, col_blocks = -(-g128 // 4), -(-g32 // 4)
    expected = {
        "fp32-g128": ((m, g128), (g128, 1), m * g128 * 4),
        # DeepGEMM: [mn, ceil(K / 512)] int32, strides (1, get_tma_aligned_size(mn, 4) = align(mn, 4)).
        "ue8m0-g128-packed": ((m, packs), (1, m4), m4 * packs * 4),
        # 128 x 4 tiles of 512 bytes: rows padded to 128, scale columns to 4.
        "mx-g32": ((m128 * col_blocks * 4,), (1,), m128 * col_blocks * 4),
    }
    for fmt in FORMATS:
        shape, strides, nbytes = expected[fmt.name]
        assert fmt.scale_shape(m, hidden) == shape
        assert fmt.scale_strides(m, hidden) == strides
        assert fmt.scale_storage_bytes(m, hidden) == nbytes
        q, scales = fp8.quantize(fmt, torch.zeros(m, hidden, dtype=torch.bfloat16))
        assert q.shape == (m, hidden) and q.dtype == torch.float8_e4m3fn
        assert (tuple(scales.shape), scales.stride(), scales.dtype) == (shape, strides, fmt.scale_dtype)
        assert scales.untyped_storage().nbytes() == nbytes


# ----------------------------------------------------------------- layouts, index by index
def _expected_bytes(fmt: fp8.Fp8Format, plain: torch.Tensor, codes: torch.Tensor, m: int, hidden: int) -> bytes:
    """The allocation written from the documented formula, one (row, group) at a time; padding 0."""
    groups = hidden // fmt.group
    if fmt.name == "fp32-g128":
        out = bytearray(4 * m * groups)
        for row in range(m):
            for group in range(groups):
                offset = 4 * (row * groups + group)
                out[offset : offset + 4] = struct.pack("<f", plain[row, group].item())
        return bytes(out)
    values = codes.tolist()
    if fmt.name == "ue8m0-g128-packed":
        # int32 word (row, group // 4) at word index (group // 4) * align(M, 4) + row, little-endian,
        # byte group % 4 of the word.
        rows_aligned = -(-m // 4) * 4
        out = bytearray(4 * rows_aligned * -(-groups // 4))
        for row in range(m):
            for group in range(groups):
                out[4 * ((group // 4) * rows_aligned + row) + group % 4] = values[row][group]
        return bytes(out)
    # mx-g32: 512-byte tiles of 128 rows x 4 groups, tiles K-fastest; inside a tile row r and
    # group c at (r % 32) * 16 + (r // 32) * 4 + c.
    col_blocks = -(-groups // 4)
    out = bytearray(-(-m // 128) * 128 * col_blocks * 4)
    for row in range(m):
        for group in range(groups):
            tile = (row // 128) * col_blocks + group // 4
            r = row % 128
            out[tile * 512 + (r % 32) * 16 + (r // 32) * 4 + group % 4] = values[row][group]
    return bytes(out)


@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_layout_matches_index_formula(fmt: fp8.Fp8Format, m: int, hidden: int) -> None:
    x = _layer_input(m, hidden, seed=m * 7 + hidden)
    _, scales = fp8.quantize(fmt, x)
    plain, codes = fp8.group_scales(fmt, x)
    assert _storage_bytes(scales) == _expected_bytes(fmt, plain, codes, m, hidden)
    # The module's offset function is the same formula; the inverse reads every scale back.
    raw = _storage_bytes(scales)
    width = 4 if fmt.scale_encoding == "fp32" else 1
    for row, group in ((0, 0), (m - 1, hidden // fmt.group - 1), (m // 2, 5)):
        offset = fmt.scale_offset(row, group, m, hidden)
        expected = struct.pack("<f", plain[row, group].item()) if width == 4 else bytes([codes[row, group].item()])
        assert raw[offset : offset + width] == expected
    assert torch.equal(fp8.unpack_scales(fmt, scales, m, hidden), plain)


def test_layout_worked_examples() -> None:
    """The examples of docs/fp8-layouts.md."""
    # ue8m0-g128-packed, M = 3, H = 5120 (G = 40, P = 10, Ma = 4): (row 2, group 9) is byte 1 of
    # word 2 * 4 + 2 = 10, byte offset 41; allocation 40 words.
    f = fp8.UE8M0_G128_PACKED
    assert f.scale_offset(2, 9, 3, 5120) == 41 and f.scale_storage_numel(3, 5120) == 40
    # mx-g32, M = 300, H = 4096 (G = 128, CB = 32): (row 200, group 70) is in tile 1 * 32 + 17 = 49,
    # r = 72: 49 * 512 + 8 * 16 + 2 * 4 + 2 = 25226; allocation 384 * 128 bytes.
    f = fp8.MX_G32
    assert f.scale_offset(200, 70, 300, 4096) == 25226 and f.scale_storage_numel(300, 4096) == 384 * 128
    assert f.scale_offset(33, 1, 1 + 33, 4096) == 1 * 16 + 1 * 4 + 1


def test_packed_words_are_deepgemm_shifts() -> None:
    """A word is byte0 | byte1 << 8 | byte2 << 16 | byte3 << 24 (DeepGEMM packs v >> 23, >> 15, >> 7, << 1)."""
    x = torch.ones(1, 5 * 128, dtype=torch.bfloat16)
    for group, value in enumerate((1.0, 2.0, 448.0, 0.5, 7.0)):
        x[0, group * 128] = value
    _, scales = fp8.quantize(fp8.UE8M0_G128_PACKED, x)
    # absmax / 448 rounded up: 1 -> 2^-8 (119), 2 -> 2^-7 (120), 448 -> 2^0 (127), 1 (0.5 < 1) -> 119,
    # 7 -> 2^-6 (121). Group 5..7 are padding: byte 0.
    assert scales.tolist() == [[119 | 120 << 8 | 127 << 16 | 119 << 24, 121]]


# ----------------------------------------------------------------- rounding, independently
def _e4m3_table() -> np.ndarray:
    """The 127 non-negative finite E4M3 values by code: subnormals c * 2^-9, then (1 + m/8) 2^(e - 7)."""
    values = [c * 2.0**-9 for c in range(8)]
    values += [(1 + mant / 8) * 2.0 ** (exp - 7) for exp in range(1, 16) for mant in range(8)]
    return np.array(values[:127])  # code 0x7F is NaN


def _e4m3_expected(v: np.ndarray) -> np.ndarray:
    """Nearest code of clamp(|v|, 448), ties to the even code, the sign bit from v's sign (-0 too)."""
    table = _e4m3_table()
    mag = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(table, mag, side="left"), 1, 126)
    lo = hi - 1
    down, up = mag - table[lo], table[hi] - mag
    code = np.where(down < up, lo, np.where(up < down, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(mag >= 448.0, 126, code)
    return (code | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def test_e4m3_cast_is_round_to_nearest_even() -> None:
    table = torch.tensor(_e4m3_table(), dtype=torch.float32)
    assert torch.equal(torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float(), table)
    # Every BF16 value, every midpoint of adjacent codes and its FP32 neighbours, both signs.
    bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    mid = (table[1:] + table[:-1]) / 2
    near = torch.cat([mid, torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(0.0))])
    values = torch.cat([bf16[torch.isfinite(bf16)], near, -near, torch.tensor([-0.0, 0.0, 448.0, -465.0, 3e38])])
    got = fp8.to_e4m3(values).view(torch.uint8).numpy()
    assert np.array_equal(got, _e4m3_expected(values.numpy()))
    # The sharp cases by name: ties go to the even code, -0 and negatives that round to zero keep
    # the sign, past 448 the clamp holds 448 (never NaN, 0x7F).
    cases = {2.0**-10: 0x00, 3 * 2.0**-10: 0x02, 5 * 2.0**-10: 0x02, -(2.0**-11): 0x80, -0.0: 0x80}
    cases |= {464.0: 0x7E, 1e30: 0x7E, -1e30: 0xFE, 13.0: 0x55, 17.0: 0x58, 19.0: 0x5A}
    got = fp8.to_e4m3(torch.tensor(list(cases))).view(torch.uint8).tolist()
    assert got == list(cases.values())


def _bf16_positive() -> torch.Tensor:
    """Every positive finite BF16 value, as FP32."""
    return torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def test_fp32_scale_is_ieee_division() -> None:
    a = _bf16_positive()
    scale = fp8.fp32_scales(torch.clamp(a, min=fp8.EPS))
    expected = np.maximum(a.numpy(), np.float32(1e-10)) / np.float32(448.0)  # numpy FP32 division
    assert np.array_equal(scale.numpy(), expected)
    # A reciprocal multiply differs: the reference must divide.
    assert not torch.equal(scale, torch.clamp(a, min=fp8.EPS) * torch.tensor(1 / 448, dtype=torch.float32))


def test_ue8m0_exponent_over_every_bf16_absmax() -> None:
    """2^ceil(log2(max(s, 1e-10))) of s = fp32(max(a, eps) / 448), for every positive BF16 a, three ways."""
    a = _bf16_positive()
    s = fp8.fp32_scales(torch.clamp(a, min=fp8.EPS))
    codes = fp8.ue8m0_exponents(s)
    floor = float(np.float32(fp8.UE8M0_FLOOR))
    expected, gaps = [], []
    for value in s.tolist():
        mant, exp = math.frexp(max(value, floor))  # value = mant * 2^exp, mant in [0.5, 1): exact
        expected.append(127 + (exp - 1 if mant == 0.5 else exp))
        if value > floor and mant != 0.5:
            gaps.append(2 * mant - 1)  # how far above the power of two below, relatively
    assert codes.tolist() == expected
    assert codes.min().item() == 94 and codes.max().item() == 127 + 120  # 2^-33 .. 2^120
    # Why log2f-based rounding (vLLM's kernel) agrees: s is a power of two exactly (a = 1.75 * 2^k,
    # 1.75 / 448 = 2^-8) or at least 2^-8 above one, so log2(s) is > 0.005 above an integer, far
    # beyond log2f's few-ulp error; and a multiply by fp32(1 / 448) (torchao, FlashInfer) rounds to
    # the same power of two.
    assert min(gaps) > 2.0**-8
    by_reciprocal = torch.clamp(a, min=fp8.EPS) * torch.tensor(1 / 448, dtype=torch.float32)
    assert torch.equal(fp8.ue8m0_exponents(by_reciprocal), codes)
    # DeepGEMM's ceil_to_ue8m0 (bits: exponent + (mantissa != 0)) is the same rule above the floor.


def test_ue8m0_decoding() -> None:
    codes = torch.tensor([0, 1, 94, 127, 254, 255], dtype=torch.uint8)
    values = fp8.ue8m0_to_float(codes)
    assert values[:5].tolist() == [2.0**-127, 2.0**-126, 2.0**-33, 1.0, 2.0**127]
    assert math.isnan(values[5].item())
    assert torch.equal(values[:5], codes[:5].view(torch.float8_e8m0fnu).float())


# ----------------------------------------------------------------- special values
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_zero_groups_and_negative_zero(fmt: fp8.Fp8Format) -> None:
    x = torch.zeros(2, 4096, dtype=torch.bfloat16)
    x[0, 1::2] = -0.0
    x[1, :] = 1.0
    x[1, 7] = -(2.0**-30)  # under E4M3's smallest subnormal at scale 1/448: rounds to -0
    q, scales = fp8.quantize(fmt, x)
    codes = q.view(torch.uint8)
    assert codes[0, 0::2].eq(0x00).all() and codes[0, 1::2].eq(0x80).all()
    assert codes[1, 7].item() == 0x80
    plain = fp8.unpack_scales(fmt, scales, 2, 4096)
    # All-zero group: absmax floored at fp32(1e-10); FP32 scale fp32(1e-10) / 448, UE8M0 2^-33.
    zero_scale = float(np.float32(1e-10) / np.float32(448)) if fmt.scale_encoding == "fp32" else 2.0**-33
    assert plain[0].eq(zero_scale).all()
    x_hat = fp8.dequantize(fmt, q, scales)
    assert x_hat[0].eq(0).all() and torch.signbit(x_hat[0, 1::2]).all() and not torch.signbit(x_hat[0, 0::2]).any()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_group_absmax_element_and_saturation(fmt: fp8.Fp8Format) -> None:
    x = _layer_input(300, 5120, seed=3)
    q, _ = fp8.quantize(fmt, x)
    values = q.float().reshape(300, -1, fmt.group)
    absmax = values.abs().amax(-1)
    groups = x.float().reshape(300, -1, fmt.group).abs().amax(-1)
    assert not torch.isnan(q.float()).any() and values.abs().max().item() <= 448
    if fmt.scale_encoding == "fp32":
        # a / fp32(a / 448) is within an FP32 ulp of 448: clamped, then exactly 448.
        live = groups > 0
        assert absmax[live].eq(448).all()
        # BF16 max saturates at exactly 448 (0x7E), never NaN (0x7F).
        assert q.view(torch.uint8)[1, 128:256].eq(0x7E).sum() == 127 and q.view(torch.uint8)[1, 130].item() == 0xFE
    else:
        # scale in [a / 448, 2 a / 448): the absmax element is y in (224, 448] (above the floor),
        # rounded to [224, 448]; 448 exactly when a / 448 is a power of two (a = 1.75 * 2^k).
        live = groups >= 448 * fp8.UE8M0_FLOOR
        assert (absmax[live] >= 224).all() and (absmax[live] <= 448).all()
        ratio = groups / 448
        exact = live & (ratio == torch.exp2(torch.ceil(torch.log2(ratio))))
        assert exact.any() and absmax[exact].eq(448).all()
        # BF16 max = 1.9921875 * 2^127: scale 2^120, y = 255, rounded to 256 (0x78).
        assert q.view(torch.uint8)[1, 128:256].eq(0x78).sum() == 127 and q.view(torch.uint8)[1, 130].item() == 0xF8


def test_tiny_groups_under_the_ue8m0_floor() -> None:
    """absmax < 448e-10: UE8M0 scale 2^-33 (vLLM's fmaxf(y_s, 1e-10f)); the values still fit."""
    x = torch.full((1, 128), 4e-8, dtype=torch.bfloat16)
    q, scales = fp8.quantize(fp8.UE8M0_G128_PACKED, x)
    assert scales.item() == 94
    assert q.float()[0, 0].item() == (x[0, :1].float() * 2.0**33).to(torch.float8_e4m3fn).float().item() == 352.0


# ----------------------------------------------------------------- round trip
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("m", (1, 129))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_trip_error_bound(fmt: fp8.Fp8Format, m: int, hidden: int) -> None:
    """|x_hat - x| <= 2^-4 |x| + 2^-10 scale (+ FP32 rounding), element by element.

    y = x / scale has |y| <= 448 (scale >= a / 448). E4M3 keeps 3 mantissa bits: on normals
    (|y| >= 2^-6) the RNE error is at most half an ulp, 2^(e-4) <= 2^-4 |y|; below, the subnormal
    step is 2^-9, so at most 2^-10. Scaling back multiplies both by the scale. The FP32 division and
    product add relative errors of 2^-24 each, and with an FP32 scale the clamp of a / s (within
    one FP32 ulp of 448) another 2^-23: covered by 2^-20 |x| of slack.

    Not at BF16's maximum (1.9921875 * 2^127): a UE8M0 scale of 2^120 and y = 255 rounded to 256
    dequantise to 2^128, past FP32's range (inf); an FP32 scale gives 448 * scale, finite. No layer
    input comes near (checked below, then the bound on inputs up to 2^100).
    """
    x_max = torch.full((1, hidden), BF16_MAX, dtype=torch.bfloat16)
    x_hat = fp8.dequantize(fmt, *fp8.quantize(fmt, x_max))
    assert torch.isinf(x_hat).all() if fmt.scale_encoding == "ue8m0" else torch.isfinite(x_hat).all()
    x = _layer_input(m, hidden, seed=m + hidden, huge=2.0**100)
    q, scales = fp8.quantize(fmt, x)
    x_hat = fp8.dequantize(fmt, q, scales)
    scale = fp8.unpack_scales(fmt, scales, m, hidden).repeat_interleave(fmt.group, 1).double()
    xf, err = x.double(), (x_hat.double() - x.double()).abs()
    bound = (2.0**-4 + 2.0**-20) * xf.abs() + 2.0**-10 * scale
    assert (err <= bound).all()
    normal = xf.abs() >= 2.0**-6 * scale
    assert (err[normal] <= (2.0**-4 + 2.0**-20) * xf.abs()[normal]).all()
    # The bound is not loose: some element comes within 10% of 2^-4 relative.
    assert (err[normal] / xf.abs()[normal]).max() > 0.9 * 2.0**-4


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_pack_unpack_inverse_and_padding(fmt: fp8.Fp8Format) -> None:
    m, hidden = 129, 4608  # G = 36 (packed: 9 full words) or 144; rows padded to 132 / 256
    x = _layer_input(m, hidden, seed=11)
    plain, codes = fp8.group_scales(fmt, x)
    scales = fp8.pack_scales(fmt, codes, hidden)
    assert torch.equal(fp8.unpack_scales(fmt, scales, m, hidden), plain)
    raw = _storage_bytes(scales)
    used = set()
    width = 4 if fmt.scale_encoding == "fp32" else 1
    for row in range(m):
        for group in range(hidden // fmt.group):
            offset = fmt.scale_offset(row, group, m, hidden)
            used.update(range(offset, offset + width))
    assert len(used) == m * (hidden // fmt.group) * width  # the offsets never collide
    assert all(raw[i] == fp8.SCALE_PADDING_BYTE for i in range(len(raw)) if i not in used)
    padding = {"fp32-g128": 0, "ue8m0-g128-packed": 3 * 9 * 4, "mx-g32": (256 - m) * 144}
    assert len(raw) - len(used) == padding[fmt.name]


def test_input_validation() -> None:
    with pytest.raises(TypeError, match="BF16"):
        fp8.quantize(fp8.FP32_G128, torch.zeros(1, 128))
    with pytest.raises(ValueError, match="multiple of the group"):
        fp8.quantize(fp8.FP32_G128, torch.zeros(1, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="non-finite"):
        fp8.quantize("mx-g32", torch.full((1, 32), float("inf"), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, H\]"):
        fp8.quantize("mx-g32", torch.zeros(32, dtype=torch.bfloat16))
    q, scales = fp8.quantize("ue8m0-g128-packed", torch.zeros(3, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        fp8.dequantize("ue8m0-g128-packed", q, scales.contiguous().reshape(-1))
