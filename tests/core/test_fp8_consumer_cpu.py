"""The FP8 consumers' reads and bounds (``tests.core.fp8_consumers``) on the CPU, on ``mhc_core.fp8.quantize``'s
output: what ``test_fp8_consumer_gpu`` applies to the op's. The reads are independent re-implementations
of the consumers' layouts, so each check here is also one of ``mhc_core.fp8``'s packing against them;
the worked byte offsets are docs/fp8-layouts.md's."""

from __future__ import annotations

import pytest
import torch

from mhc_core import fp8
from tests.core import fp8_consumers as consumers

#: (M, hidden): one row; padding rows of the packed layout (M % 4) and of the swizzled one (a second,
#: partial 128-row tile); 41 groups of 128 (a partial packed word) and 161 of 32 (a partial 4-group block).
SHAPES = ((1, 5120), (5, 4096), (130, 5120), (7, 5248), (3, 5152))


def nonnegative_input(m: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """Non-negative BF16 with -0 kept, per-group power-of-two factors, an all-zero group, a -0 group,
    a group of 32 below the absmax floor and one large group."""
    values = torch.randn(m, hidden, generator=generator).abs()
    values *= torch.exp2((torch.arange(hidden) // 128 % 5 - 2).float())
    values[:, 0:128] = 0.0
    values[:, 128:256] = -0.0
    values[:, 256:288] *= 2.0**-120
    values[:, 384:512] *= 2.0**60
    values[:, 600:700] = torch.where(torch.rand(m, 100, generator=generator) < 0.2, -0.0, values[:, 600:700])
    return values.to(torch.bfloat16)


def formats_for(hidden: int) -> list[str]:
    return [name for name in consumers.FORMATS if hidden % consumers.GROUP[name] == 0]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"m{s[0]}-h{s[1]}")
def test_reads_find_the_expected_scales_and_zero_padding(shape: tuple[int, int]) -> None:
    m, hidden = shape
    generator = torch.Generator().manual_seed(m * hidden)
    x = nonnegative_input(m, hidden, generator)
    for name in formats_for(hidden):
        q, scales = fp8.quantize(name, x)
        rows = consumers.READS[name](scales, m, hidden)
        expected = consumers.expected_scales(name, x)
        assert torch.equal(rows.view(torch.int32), expected.view(torch.int32)), name
        assert torch.equal(rows, fp8.unpack_scales(name, scales, m, hidden)), f"{name}: against mhc_core's unpack"
        assert not bool(consumers.padding(name, scales, m, hidden).any()), f"{name}: padding bytes"
        error = (consumers.dequantized(q, rows) - x.double()).abs()
        bound = 2.0**-4 * (1 + 2.0**-19) * x.double().abs() + 2.0**-10 * rows.double().repeat_interleave(
            consumers.GROUP[name], dim=1
        )
        assert bool((error <= bound).all()), f"{name}: q * scale outside the quantisation bound"


def test_worked_offsets_of_the_docs() -> None:
    """docs/fp8-layouts.md: packed, M = 3, H = 5120: (row 2, group 9) is byte 41; swizzled, M = 300,
    H = 4096: (row 200, group 70) is byte 25226. One code set there, read back by the consumers' reads."""
    for name, m, hidden, row, group, offset in (
        ("ue8m0-g128-packed", 3, 5120, 2, 9, 41),
        ("mx-g32", 300, 4096, 200, 70, 25226),
    ):
        codes = torch.full((m, hidden // consumers.GROUP[name]), 100, dtype=torch.uint8)
        codes[row, group] = 140
        scales = fp8.pack_scales(name, codes, hidden)
        assert consumers.raw_bytes(scales)[offset].item() == 140, name
        rows = consumers.READS[name](scales, m, hidden)
        assert rows[row, group].item() == 2.0**13 and int((rows == 2.0**13).sum()) == 1, name


def test_a_misread_fails_the_checks() -> None:
    """The checks are not vacuous: scales read one group off, or one factor of two off, fail them."""
    m, hidden = 6, 5120
    generator = torch.Generator().manual_seed(7)
    x = nonnegative_input(m, hidden, generator)
    weight = torch.randn(64, hidden, generator=generator).abs().to(torch.bfloat16).double()
    for name in consumers.FORMATS:
        q, scales = fp8.quantize(name, x)
        rows = consumers.READS[name](scales, m, hidden)
        shifted = torch.roll(rows, 1, dims=1)
        assert not torch.equal(shifted, consumers.expected_scales(name, x)), name
        exact, bound = consumers.product_bound(x, rows, weight, accumulation=consumers.FP64_ACCUMULATION, output=0.0)
        worst = consumers.assert_within_bound(consumers.dequantized(q, rows) @ weight.t(), exact, bound, name)
        assert worst < 0.5, f"{name}: the bound is far from the error ({worst})"
        with pytest.raises(AssertionError, match="outside the bound"):
            consumers.assert_within_bound(consumers.dequantized(q, rows * 2) @ weight.t(), exact, bound, name)


def test_hopper_bound_leaves_room_for_an_fp8_gemm() -> None:
    """The real-GEMM bound (quantisation + Hopper's accumulation + BF16 output) is a few percent of the
    product, far below what a wrong scale does (a factor of two)."""
    m, hidden = 4, 5120
    generator = torch.Generator().manual_seed(8)
    x = nonnegative_input(m, hidden, generator)
    _, scales = fp8.quantize("fp32-g128", x)
    rows = consumers.read_row_major(scales, m, hidden)
    weight = torch.randn(256, hidden, generator=generator).abs().to(torch.bfloat16)
    _, _, w_hat = consumers.block_quantized_weight(weight)
    exact, bound = consumers.product_bound(
        x, rows, w_hat, accumulation=consumers.hopper_fp8_accumulation(hidden // 128), output=consumers.BF16_OUTPUT
    )
    relative = bound / exact
    assert bool((relative < 0.1).all()) and bool((relative > 0.05).all()), relative.max().item()


def test_weights_quantise_within_the_e4m3_bound() -> None:
    """The GPU test's weights: 128 x 128 blocks with FP32 scales, and MXFP8 (UE8M0 per 32 in the 128x4
    swizzle, read back by the consumer's read); each within E4M3's bound of the BF16 weight."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(256, 512, generator=generator).to(torch.bfloat16)
    exact = weight.double()
    q, scales, w_hat = consumers.block_quantized_weight(weight)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (2, 4) and scales.is_contiguous()
    spread = scales.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    assert bool(((w_hat - exact).abs() <= 2.0**-4 * exact.abs() + 2.0**-10 * spread).all())
    q, codes, w_hat = consumers.mx_quantized_weight(weight)
    powers = consumers.read_swizzled(codes, 256, 512)
    assert codes.numel() == 256 * 16 and torch.equal(powers, consumers.expected_scales("mx-g32", weight))
    spread = powers.double().repeat_interleave(32, dim=1)
    assert bool(((w_hat - exact).abs() <= 2.0**-4 * exact.abs() + 2.0**-10 * spread).all())


def test_scaled_mm_probe_says_why_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the GPU test runs the probe")
    assert consumers.scaled_mm_problem("1x128") == "no CUDA GPU"
